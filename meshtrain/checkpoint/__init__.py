"""Training checkpoints: DCP save/restore with atomic publish, keep-last, async and resharding."""
