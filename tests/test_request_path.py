"""One non-streamed request passes few files and functions (benchmarks/trace_request.py traces it): the request
path is something a newcomer reads in one sitting, and docs/architecture.md's figure stays true. Nine files since
the grant pass moved out of dispatcher.py into grants.py (the two halves of the request path, each under STYLE's
~500 lines); the functions are the same 35."""

from __future__ import annotations

from fedpool.benchmarks.trace_request import trace_one

MAX_FILES = 9
MAX_FUNCTIONS = 40


async def test_one_request_passes_at_most_9_files_and_40_functions() -> None:
    trace = await trace_one(servers=4)
    summary = trace.summary()
    assert summary["functions"] > 10  # the trace saw the request (a broken tracer counts nothing)
    assert "federation/dispatcher.py" in summary["by_file"] and "federation/grants.py" in summary["by_file"]
    assert summary["files"] <= MAX_FILES, summary["by_file"]
    assert summary["code_objects"] <= MAX_FUNCTIONS, summary
