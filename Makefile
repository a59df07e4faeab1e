# The two commands of the README. Each sets up .venv itself (idempotent) first.
.PHONY: setup train test

setup:
	@bash launch/setup_env.sh

# The main job: a tiny Llama on the bundled corpus, 4 CPU ranks (TP2 x SP x FSDP DP2).
train: setup
	bash launch/torchrun.sh 4 --config configs/debug.yaml

# The whole suite, slow multi-rank tests included.
test: setup
	.venv/bin/python -m pytest tests
