"""What one job of a batch does on every rank (tests/batch_worker.py): each module has run(args, out, runtime)."""
