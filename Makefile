# The two commands of the README (train, test), each setting up .venv itself (idempotent) first; test-fast for contributors.
.PHONY: setup train test test-fast

setup:
	@bash launch/setup_env.sh

# The main job: a tiny Llama on the bundled corpus, 4 CPU ranks (TP2 x SP x FSDP DP2).
train: setup
	bash launch/torchrun.sh 4 --config configs/debug.yaml

# The whole suite, slow multi-rank tests included.
test: setup
	.venv/bin/python -m pytest tests

# The fast tier for contributors (~2 min): unit tests and single-process runs (docs/tests.md).
test-fast: setup
	.venv/bin/python -m pytest -m "not slow" tests
