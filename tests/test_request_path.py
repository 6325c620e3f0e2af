"""One non-streamed request passes few files and functions (benchmarks/trace_request.py traces it, from
`Dispatcher.submit` through the HTTP exchange with the server and back): the request path is something a newcomer
reads in one sitting, and docs/architecture.md's figure stays true. At most 8 files and 40 functions, counted
honestly: no method inlined into another object's state to make the count, and the keep-alive HTTP exchange
(federation/gateway/transport.py: the request, and the parser's callbacks) counted with the rest."""

from __future__ import annotations

from fedpool.benchmarks.trace_request import trace_one

MAX_FILES = 8
MAX_FUNCTIONS = 40


async def test_one_request_passes_at_most_8_files_and_40_functions() -> None:
    trace = await trace_one(servers=4)
    summary = trace.summary()
    assert summary["functions"] > 10  # the trace saw the request (a broken tracer counts nothing)
    by_file = summary["by_file"]
    assert {"federation/core/dispatcher.py", "federation/core/grants.py", "federation/gateway/transport.py"} <= set(
        by_file)  # the dispatcher, its grant pass and the HTTP exchange are all in it
    assert summary["files"] <= MAX_FILES, by_file
    assert summary["code_objects"] <= MAX_FUNCTIONS, summary
