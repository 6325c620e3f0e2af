"""Progress of running evals that people can read: a live rich table on a terminal (per eval: done /
total, rate, ETA, failed, retried; per server: answered, in flight, window, errors), plain lines every few
seconds when the output is a log, nothing with `quiet`. The eval clients' own view of their progress (what
`run_evals` reports as EvalProgress, beside the dispatcher's per-server stats), used by `fedpool eval` and
`fedpool demo`."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from fedpool.clients import EvalProgress
from fedpool.federation import Dispatcher

PLAIN_EVERY_S = 10.0
LIVE_EVERY_S = 0.5


def _eta(p: EvalProgress) -> float | None:
    rate = p.done / p.elapsed_s if p.elapsed_s > 0 else 0.0
    return (p.total - p.done) / rate if rate > 0 else None


class ProgressView:
    """`view.update` is the evals' `on_progress`; `async with view:` draws until the block ends."""

    def __init__(self, dispatcher: Dispatcher | None, *, mode: str = "auto", out: TextIO | None = None,
                 every_s: float = PLAIN_EVERY_S, clock: Callable[[], float] = time.monotonic):
        self._dispatcher = dispatcher
        self._out = out or sys.stderr
        if mode == "auto":
            mode = "live" if self._out.isatty() else "plain"
        if mode not in ("live", "plain", "quiet"):
            raise ValueError(f"progress mode must be live, plain or quiet, not {mode!r}")
        self.mode = mode
        self._every_s = every_s
        self._clock = clock
        self._started = clock()
        self._latest: dict[str, EvalProgress] = {}
        self._task: asyncio.Task[None] | None = None

    def update(self, progress: EvalProgress) -> None:
        self._latest[progress.benchmark] = progress

    async def __aenter__(self) -> ProgressView:
        if self.mode != "quiet":
            self._task = asyncio.get_running_loop().create_task(self._draw_forever())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def lines(self) -> list[str]:
        """One plain line per eval (what logs get)."""
        out = []
        for p in self._latest.values():
            eta = _eta(p)
            rate = p.done / p.elapsed_s if p.elapsed_s > 0 else 0.0
            out.append(f"{p.benchmark}: {p.done}/{p.total} ({100 * p.done / max(1, p.total):.0f}%), "
                       f"{rate:.1f}/s, ETA {'-' if eta is None else f'{eta:.0f}s'}, {p.failed} failed, "
                       f"{p.retried} retried")
        return out

    def table(self) -> Any:
        from rich.console import Group
        from rich.table import Table

        evals = Table(title=f"evaluations · {self._clock() - self._started:.0f} s", expand=False)
        for column in ("eval", "done / total", "%", "rate", "ETA", "failed", "retried"):
            evals.add_column(column, justify="left" if column == "eval" else "right")
        for p in self._latest.values():
            eta = _eta(p)
            rate = p.done / p.elapsed_s if p.elapsed_s > 0 else 0.0
            evals.add_row(p.benchmark, f"{p.done} / {p.total}", f"{100 * p.done / max(1, p.total):.0f}",
                          f"{rate:.1f}/s", "-" if eta is None else f"{eta:.0f} s", str(p.failed), str(p.retried))
        if self._dispatcher is None:
            return evals
        servers = Table(title="servers", expand=False)
        for column in ("server", "answered", "in flight", "window", "errors", "learned tok/s"):
            servers.add_column(column, justify="left" if column == "server" else "right")
        for s in self._dispatcher.stats().servers:
            learned = "-" if s.learned_tokens_per_s is None else f"{s.learned_tokens_per_s:.0f}"
            servers.add_row(s.server_id, str(s.answered), str(s.inflight), str(s.window),
                            str(sum(s.failures.values())), learned)
        return Group(evals, servers)

    async def _draw_forever(self) -> None:
        if self.mode == "plain":
            while True:
                await asyncio.sleep(self._every_s)
                stamp = f"[{self._clock() - self._started:5.0f}s]"
                for line in self.lines():
                    print(f"{stamp} {line}", file=self._out, flush=True)
        from rich.console import Console
        from rich.live import Live

        with Live(self.table(), console=Console(file=self._out), refresh_per_second=4, transient=True) as live:
            while True:
                await asyncio.sleep(LIVE_EVERY_S)
                live.update(self.table())
