"""Who is on the pool, for a person at a terminal: `fedpool pool status` (the pool's servers and totals, then every
holder with its clients, their progress and ETAs, and the slots it holds against its fair share) and `fedpool pool
top`, the same refreshed in place until Ctrl-C, as `top` does. The view is the lease broker's
(registry/holders.py); nothing here keeps state between refreshes."""

from __future__ import annotations

import asyncio
import contextlib
import io
import shutil
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from fedpool.federation import HolderView, PoolHolders, PoolSnapshot

TOP_INTERVAL_S = 2.0
FINISHED_SHOWN = 10  # recently finished clients in the view, newest first


class HoldersRegistry(Protocol):
    """What these views ask of a registry client (the Ray client and the HTTP client both)."""

    async def snapshot(self, since_version: int = -1, timeout_s: float = 0.0) -> PoolSnapshot: ...

    async def holders(self) -> PoolHolders: ...


async def pool_status(registry: HoldersRegistry) -> dict[str, Any]:
    """The pool's summary (`PoolSnapshot.summary`) with, from the lease broker, every holder (`holders`), the clients
    finished lately (`finished`), each server's leased slots (`lease_servers`) and whether the broker is still
    learning after a restart (`leases_learning`)."""
    summary = (await registry.snapshot()).summary()
    view = await registry.holders()
    wire = view.model_dump(mode="json")
    return {**summary, "holders": wire["holders"], "finished": wire["finished"], "lease_servers": wire["servers"],
            "leases_learning": view.learning, "taken_at": view.taken_at}


def status_text(status: dict[str, Any]) -> RenderableType:
    """`pool_status` for a person: the totals, then who is on the pool."""
    lines = [f"{status['servers']} server(s): " + ", ".join(f"{n} {s}" for s, n in sorted(status["by_status"].items())),
             f"routable capacity {status['capacity_routable']} sequences; running {status['running']:.0f}, waiting "
             f"{status['waiting']:.0f}, {status['tokens_per_s']:.1f} tokens/s"]
    lines += [f"  {g['servers']} × {g['engine']} on {g['accelerator']} ({g['status']})" for g in status["groups"]]
    lines += [f"  model {m}: {n} server(s)" for m, n in sorted(status["models"].items())]
    view = PoolHolders.model_validate({"taken_at": status["taken_at"], "broker": "", "learning":
                                       status["leases_learning"], "holders": status["holders"],
                                       "finished": status["finished"], "servers": status["lease_servers"]})
    return Group(Text("\n".join(lines)), Text(""), holders_view(view))


def rendered(renderable: RenderableType) -> str:
    """A view as plain text, as wide as the terminal (at least 100 columns): for `pool status`, piped or not."""
    console = Console(file=io.StringIO(), width=max(100, shutil.get_terminal_size().columns), color_system=None)
    with console.capture() as captured:
        console.print(renderable)
    return captured.get().rstrip()


def holders_view(view: PoolHolders, *, now: float | None = None) -> RenderableType:
    """Every holder (what it is, where, since when, its slots against its fair share, what it waits for), then
    every client with its progress and ETA, then the clients finished lately."""
    now = view.taken_at if now is None else now
    if not view.holders:
        head = Text("nobody holds a lease on the pool" + (" (the broker restarted and is still learning)"
                                                          if view.learning else ""), style="italic")
        return Group(head, *([_finished(view, now)] if view.finished else []))
    holders = Table(title="holders", title_justify="left", expand=False)
    for name, right in (("holder", False), ("kind", False), ("state", False), ("host:pid", False), ("for", True),
                        ("slots / fair", True), ("in flight", True), ("waiting", True), ("by server kind", False)):
        holders.add_column(name, justify="right" if right else "left", no_wrap=True)
    for h in view.holders:
        inflight = sum(s.inflight for s in h.servers)
        waiting = max(0, sum(c.wanted for c in h.clients) - inflight)
        kinds = ", ".join(f"{k.kind}: {k.slots}/{k.fair_share}" for k in h.kinds if k.slots or k.fair_share)
        holders.add_row(_short(h.holder), h.kind, h.state, _where(h), _ago(now - h.since),
                        f"{h.slots} / {h.fair_share}", str(inflight), str(waiting), kinds or "–")
    idle = Text("no client running", style="italic")
    parts: list[RenderableType] = [holders, _clients(view, now) if any(h.clients for h in view.holders) else idle]
    if view.finished:
        parts.append(_finished(view, now))
    if view.learning:
        parts.append(Text("the broker restarted and is still learning what the previous one leased", style="italic"))
    return Group(*parts)


def _clients(view: PoolHolders, now: float) -> Table:
    table = Table(title="clients", title_justify="left")
    for name, right in (("holder", False), ("client", False), ("model", False), ("state", False), ("done", True),
                        ("left", True), ("rate", True), ("ETA", True), ("for", True)):
        table.add_column(name, justify="right" if right else "left", no_wrap=True)
    for h in view.holders:
        for c in h.clients:
            table.add_row(_short(h.holder), c.client, c.model, c.state, str(c.done),
                          "–" if c.requests_left is None else str(c.requests_left),
                          "–" if c.rate_per_s is None else f"{c.rate_per_s:.1f}/s",
                          "–" if c.eta_s is None else _ago(c.eta_s), _ago(now - c.since))
    return table


def _finished(view: PoolHolders, now: float) -> Table:
    table = Table(title="finished lately", title_justify="left")
    for name, right in (("client", False), ("model", False), ("holder", False), ("outcome", False), ("done", True),
                        ("left", True), ("ended", True)):
        table.add_column(name, justify="right" if right else "left", no_wrap=True)
    for f in view.finished[:FINISHED_SHOWN]:
        table.add_row(f.client, f.model, f"{f.holder_kind} {_short(f.holder)}", f.outcome or "–", str(f.done),
                      "–" if f.requests_left is None else str(f.requests_left),
                      f"{_ago(now - f.ended_at)} ago" if f.ended_at is not None else "–")
    return table


def _short(holder: str) -> str:
    """A holder's name without its host (shown beside it): pid and random part."""
    return holder.split(":", 1)[1] if holder.count(":") == 2 else holder


def _where(h: HolderView) -> str:
    return f"{h.host}:{h.pid}" if h.host and h.pid else (h.host or "–")


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds // 60:.0f}m{seconds % 60:02.0f}s"
    return f"{seconds // 3600:.0f}h{seconds % 3600 // 60:02.0f}m"


async def top(registry: HoldersRegistry, stop: asyncio.Event, *, interval_s: float = TOP_INTERVAL_S,
              console: Console | None = None, clock: Callable[[], float] = time.time) -> None:
    """`pool_status` redrawn in place every `interval_s` until `stop` is set; a registry that does not answer is
    said on the screen, and asked again at the next refresh."""
    console = console or Console()
    with Live(console=console, auto_refresh=False, screen=console.is_terminal, transient=False) as live:
        while not stop.is_set():
            try:
                shown: RenderableType = status_text(await pool_status(registry))
            except Exception as exc:  # (the registry restarting: the screen says so, the loop goes on)
                shown = Text(f"the registry did not answer: {type(exc).__name__}: {exc}", style="bold red")
            stamp = Text(f"fedpool pool top · {time.strftime('%H:%M:%S', time.localtime(clock()))} · every "
                         f"{interval_s:g}s · Ctrl-C to quit", style="dim")
            live.update(Group(stamp, shown), refresh=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)


def server_table(rows: Sequence[dict[str, Any]]) -> str:
    """`fedpool server list`: one line per server, in columns."""

    def num(value: float | None, spec: str = "g", scale: float = 1) -> str:
        return "-" if value is None else f"{value * scale:{spec}}"

    table = [("ID", "ENGINE", "ACCEL", "MODEL", "STATUS", "RUN", "WAIT", "KV%", "TOK/S")] + [
        (r["id"], r["engine"], r["accelerator"], r["model"], r["status"], num(r["running"]), num(r["waiting"]),
         num(r["kv_cache_usage"], ".0f", 100), num(r["tokens_per_s"], ".1f")) for r in rows]
    widths = [max(len(str(row[i])) for row in table) for i in range(len(table[0]))]
    lines = ["  ".join(str(cell).ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in table]
    return "\n".join(lines + ([] if rows else ["(no servers registered; add one with `fedpool server add`)"]))
