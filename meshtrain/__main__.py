from meshtrain.cli import entry

entry()
