# One command each, on a fresh machine: `make train` (main job) and `make test` (test suite).
ARGS ?=

.PHONY: train test test-slow bench

train:
	scripts/setup_venv.sh gguf
	.venv/bin/python train.py $(ARGS)

test:
	scripts/setup_venv.sh test
	.venv/bin/python -m pytest -q $(ARGS)

test-slow:
	scripts/setup_venv.sh test
	.venv/bin/python -m pytest -q -m slow $(ARGS)
