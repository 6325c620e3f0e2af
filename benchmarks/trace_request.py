"""One non-streamed request, traced: which of fedpool's files and functions it passes through.

    python -m fedpool.benchmarks.trace_request [--servers 4] [--policy capacity_weighted] [--json]

Four emulated servers run in a child process (their code is the servers', not the request path's). One
dispatcher over them sends 40 requests first (connections open, speeds learned, the hedge timer armed), then
one greedy request (temperature 0: hedging applies, as it does to most eval requests) is traced with
`sys.setprofile` from the call of `Dispatcher.submit` to its return: every Python function that runs meanwhile
in this process — the awaiting coroutine and every callback the loop runs for it (the grant pass, aiohttp's
internals) — and whose code lives in one of fedpool's rooms. The dispatcher's periodic tick is not the request's:
it runs only while requests wait (none does here), but one armed during the warm-up may still be due, and on a
loaded machine it can fall inside the traced request; the warm-up waits it out, and anything the tick runs is
left out of the count all the same. So is a learning period closing (once per server every few seconds: a window
decision, the weights' refresh): the dispatcher runs with a period longer than the run. Counted two ways: named
functions (`def`, methods and properties included) and every code object (with lambdas, comprehensions and
generator expressions). docs/architecture.md quotes the figures; tests/test_request_path.py holds them to ≤ 8
files and ≤ 40 functions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedpool.federation.gateway.transport import HttpTransport

ROOMS = ("registry", "federation", "clients", "pipeline", "deploy", "benchmarks", "fedpool")
MODEL = "trace-model"
ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Trace:
    files: dict[str, set[str]] = field(default_factory=dict)  # file -> functions (qualified names)
    lambdas: set[str] = field(default_factory=set)  # lambdas, comprehensions, generator expressions

    @property
    def functions(self) -> int:
        return sum(len(names) for names in self.files.values())

    def summary(self) -> dict[str, Any]:
        return {"files": len(self.files), "functions": self.functions,
                "code_objects": self.functions + len(self.lambdas),
                "by_file": {f: sorted(names) for f, names in sorted(self.files.items())},
                "lambdas": sorted(self.lambdas)}


def _room_file(filename: str) -> str | None:
    """The repository-relative path of a file in one of fedpool's rooms (through fedpool/'s symlinks too)."""
    try:
        rel = Path(filename).resolve().relative_to(ROOT)
    except ValueError:
        return None
    return str(rel) if rel.parts and rel.parts[0] in ROOMS else None


@contextmanager
def tracing(trace: Trace, skip: frozenset[types.CodeType] = frozenset()) -> Iterator[None]:
    """Count what runs in fedpool's rooms, except what runs under a function whose code is in `skip`."""

    def under_skipped(frame: types.FrameType | None) -> bool:
        while frame is not None:
            if frame.f_code in skip:
                return True
            frame = frame.f_back
        return False

    def profile(frame: types.FrameType, event: str, arg: object) -> None:
        if event != "call":
            return
        code = frame.f_code
        if skip and under_skipped(frame):
            return
        where = _room_file(code.co_filename)
        if where is None or where.endswith("trace_request.py"):
            return
        name = code.co_qualname
        if name.endswith(("<lambda>", "<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")):
            trace.lambdas.add(f"{where}:{name}")
        else:
            trace.files.setdefault(where, set()).add(name)

    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(None)


async def trace_one(servers: int = 4, policy: str = "capacity_weighted") -> Trace:
    from fedpool.federation import DispatchConfig, Dispatcher, Endpoint, InferenceRequest, make_policy, new_session
    from fedpool.federation.core.grants import WAIT_POLL_S
    from fedpool.registry import Engine, PoolSnapshot, ServerEntry, ServerRecord, ServerStatus, prior_weight

    # Each emulator binds a port of its own choosing (--port 0) and says which: no port is picked here and then
    # taken by another process before the child binds it.
    procs = [await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fedpool.deploy.emulator", "--model", MODEL, "--port", "0", "--profile", "tiny",
        stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(servers)]
    try:
        urls = [await _url_of(proc) for proc in procs]
        entries = []
        for i, url in enumerate(urls):
            record = ServerRecord(id=f"s{i}", url=url, engine=Engine.VLLM, model=MODEL,
                                  revision="r1", accelerator="A100", capacity=8)
            entries.append(ServerEntry(record=record, status=ServerStatus.HEALTHY, capacity=8,
                                       weight=prior_weight(record)))
        snapshot = PoolSnapshot(version=1, taken_at=time.time(), entries=tuple(entries))

        def request(i: int) -> InferenceRequest:
            return InferenceRequest.from_body({"prompt": f"What is {i} plus {i}?", "max_tokens": 8, "temperature": 0},
                                              request_id=f"t{i}", model=MODEL, endpoint=Endpoint.COMPLETIONS,
                                              client_id="eval")

        async with new_session() as session:
            # A learning period closing (once per server per learn_period_s: a window decision, the weights' refresh)
            # is the learning's work, not a request's: like the periodic tick, it is kept out of the traced request
            # (a period longer than the run; at the default 2 s, a slow warm-up let one close inside the trace).
            config = DispatchConfig(learn_period_s=600.0)
            dispatcher = Dispatcher(HttpTransport(session, config.timeouts), lambda: snapshot, make_policy(policy),
                                    config=config)
            await asyncio.gather(*(dispatcher.submit(request(i)) for i in range(40)))
            for i in range(4):
                await dispatcher.submit(request(100 + i))  # one at a time, as the traced one
            await asyncio.sleep(2 * WAIT_POLL_S)  # a tick armed while the warm-up's requests waited runs now
            trace = Trace()
            traced = request(999)
            with tracing(trace, skip=frozenset({Dispatcher._tick.__code__})):
                await dispatcher.submit(traced)
        return trace
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.terminate()
        for proc in procs:
            await proc.wait()


async def _url_of(proc: asyncio.subprocess.Process, timeout_s: float = 60.0) -> str:
    """The URL an emulator child serves on, from the line it prints once it listens; its error if it died."""
    assert proc.stdout is not None and proc.stderr is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), timeout_s)
    except TimeoutError:
        raise RuntimeError(f"the emulated server did not start within {timeout_s:.0f} s") from None
    if b" on http://" not in line:
        await proc.wait()
        error = (await proc.stderr.read()).decode(errors="replace")[-2000:]
        raise RuntimeError(f"the emulated server exited with {proc.returncode}: {error}")
    return line.decode().rsplit(" on ", 1)[1].strip()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fedpool.benchmarks.trace_request",
                                     description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--policy", default="capacity_weighted")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    summary = asyncio.run(trace_one(args.servers, args.policy)).summary()
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(f"one non-streamed request on {args.servers} servers ({args.policy}): {summary['files']} files, "
          f"{summary['functions']} functions ({summary['code_objects']} with lambdas and comprehensions)")
    for path, names in summary["by_file"].items():
        print(f"  {path} ({len(names)}): {', '.join(names)}")
    if summary["lambdas"]:
        print(f"  lambdas and comprehensions: {', '.join(summary['lambdas'])}")


if __name__ == "__main__":
    main()
