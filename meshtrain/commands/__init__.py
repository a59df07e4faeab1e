"""The subcommands behind ``meshtrain <command>``: train, convert (plan is in meshtrain.planning)."""
