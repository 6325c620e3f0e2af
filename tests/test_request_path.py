"""One non-streamed request passes few files and functions (benchmarks/trace_request.py traces it): the request
path is something a newcomer reads in one sitting, and docs/architecture.md's figure stays true. Nine files since
the grant pass moved out of dispatcher.py into grants.py (the two halves of the request path, each under STYLE's
~500 lines), 35 functions; ten files and 46 functions since the HTTP exchange itself left aiohttp's client (which
the trace does not count) for fedpool's keep-alive pool (federation/gateway/upstream.py, 11 of them: the request, and
the
parser's callbacks), for half the CPU a relayed request (benchmarks/results/gateway_capacity.md: 67.9 µs against
136.6)."""

from __future__ import annotations

from fedpool.benchmarks.trace_request import trace_one

MAX_FILES = 10
MAX_FUNCTIONS = 50


async def test_one_request_passes_at_most_10_files_and_50_functions() -> None:
    trace = await trace_one(servers=4)
    summary = trace.summary()
    assert summary["functions"] > 10  # the trace saw the request (a broken tracer counts nothing)
    assert "federation/core/dispatcher.py" in summary["by_file"] and "federation/core/grants.py" in summary["by_file"]
    assert summary["files"] <= MAX_FILES, summary["by_file"]
    assert summary["code_objects"] <= MAX_FUNCTIONS, summary
