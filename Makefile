# The two commands of the README. Both set everything up first (scripts/bootstrap.sh is idempotent).
.PHONY: setup demo test lint

setup:
	./scripts/bootstrap.sh

demo: setup
	.venv/bin/fedpool demo

test: setup
	.venv/bin/python -m pytest -ra

lint: setup
	.venv/bin/ruff check .
