"""What each holder (a process whose dispatcher uses the pool) tells the lease broker every renewal: its clients'
demand per model, what it has in flight and holds, and who it is. The wire format of `RegistryActor.lease`; the
broker that shares the slots by it is registry/leases.py, the view of who is on the pool registry/holders.py."""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

# What kind of process a holder is: `fedpool eval run`, a gateway, a jobs server, a batch runner; "other" where it
# does not say.
HolderKind = Literal["eval run", "gateway", "jobs server", "batch", "other"]
HOLDER_KINDS: tuple[HolderKind, ...] = ("eval run", "gateway", "jobs server", "batch", "other")


def holder_id() -> str:
    """A process's name at the broker, unique in the cluster: host, pid and a random part."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class HolderInfo(BaseModel):
    """Who a holder is, for the people watching the pool; nothing is shared by it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: HolderKind = "other"
    host: str = Field(default="", max_length=255)
    pid: int = Field(default=0, ge=0)
    started_at: float = Field(default=0.0, ge=0)  # wall-clock (Unix) time the process joined the pool


def holder_info(kind: HolderKind = "other", wall_clock: Callable[[], float] = time.time) -> HolderInfo:
    """This process as a holder of `kind`, joining the pool now."""
    return HolderInfo(kind=kind, host=socket.gethostname(), pid=os.getpid(), started_at=wall_clock())


class ClientDemand(BaseModel):
    """One client of a holder, on one model."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    client: str = Field(min_length=1, max_length=256)
    wanted: int = Field(ge=0)  # requests waiting + in flight: the slots it could use now
    rank: float = 0.0  # the client order's criterion; smaller first
    weight: float = Field(default=1.0, gt=0)
    # Ranked by the service it has had (shortest_first, a client that reports no work left): the slot-seconds
    # its answered requests held. The broker ranks it by these on the work scale of every holder's answers, so
    # two processes whose own answers so far differ put one client before another the same way.
    served_s: float | None = Field(default=None, ge=0)
    # With `served_s`: the slot-seconds one of its requests is expected to hold (None: not said) and its requests
    # in flight, which `served_s` counts at that each; without it (nothing answered anywhere yet), the engine steps
    # one of its requests takes by its shape, its level starting at 0. The broker shares by levels of service, as
    # one gateway serves each free slot to the caller least served so far: a caller whose requests are short is
    # given as many more slots (registry/fills.py `level_fill`), where equal slots made a short lm-eval run 1.2-1.5x
    # slower behind its own gateway replica than behind one gateway shared with a long one.
    request_s: float | None = Field(default=None, gt=0)
    running: int = Field(default=0, ge=0)
    # Not ready yet: an eval still reading its samples (`wanted`: what it may send at most). Its rank says nothing
    # yet, so it shares the first class of the order by weight — without it, the process whose eval loaded a moment
    # sooner took every slot, and as slots are not taken back once its requests run, an eval of another process
    # started together waited whole answers for its share.
    loading: bool = False
    # The work it says it has left, whatever the order (fedpool's evals; a gateway caller that declared its
    # requests); None where it says nothing. Shares that do not come out in whole slots are rounded towards the
    # holders nearest their end, so a short eval tied with long ones does not end later than in one process.
    work_left: float | None = Field(default=None, ge=0)
    # For the people watching the pool (registry/holders.py), not for sharing: its requests answered so far, the
    # requests it says it has left (None: it says nothing) and whether it has sent its last.
    answered: int = Field(default=0, ge=0)
    requests_left: int | None = Field(default=None, ge=0)
    sent_all: bool = False
    # Server kind -> what one of its requests costs there (`ModelDemand.kind_costs`' units; empty: its holder's
    # mean): a process running several evals has its clients' slots placed each on the kinds its work suits.
    kind_costs: dict[str, float] = Field(default_factory=dict)


class ModelDemand(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(min_length=1)
    clients: tuple[ClientDemand, ...] = ()
    # Server kind (`snapshot.server_kind`) -> what one of this holder's requests costs on a server of that kind
    # (any unit; only the ratios between kinds count): its slots are placed on the kinds its work suits.
    kind_costs: dict[str, float] = Field(default_factory=dict)
    # Its dispatcher's client order (DispatchConfig.client_order; "" unknown): where every holder's order aims at
    # the makespan (fair, longest answers first), the broker's plan finishes the holders together.
    order: str = Field(default="", max_length=64)


class Served(NamedTuple):
    """Answers summed: their work (prompt + 2 × completion tokens), the slot-seconds they held and their completion
    tokens. One process's (`DemandReport`), or every holder's as the broker last summed them (`Lease.pool_served`):
    what a process that has had no answer yet prices its callers' requests by."""

    work: float = 0.0
    slot_s: float = 0.0
    answer_tokens: float = 0.0


class DemandReport(BaseModel):
    """What one holder (a dispatcher) sends each renewal. The wire format of `RegistryActor.lease`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    holder: str = Field(min_length=1, max_length=128)
    models: tuple[ModelDemand, ...] = ()
    inflight: dict[str, int] = Field(default_factory=dict)  # server id -> attempts in flight there
    held: dict[str, int] = Field(default_factory=dict)  # server id -> slots of the lease it holds now
    broker: str | None = None  # the incarnation that granted `held` (None: none yet)
    # Every answer this holder has had: its work (prompt + 2 × completion tokens) and the slot-seconds it held.
    served_work: float = Field(default=0.0, ge=0)
    served_slot_s: float = Field(default=0.0, ge=0)
    served_answer_tokens: float = Field(default=0.0, ge=0)  # and their completion tokens
    # An announcement (`loading_report`): what a process is about to run, sent before it can use a lease. Its
    # clients count in the shares — nobody else is leased their slots — but it is leased nothing until it reports
    # as a holder: the slots a process still starting up was leased could go to nobody until it said it held them.
    announce: bool = False
    info: HolderInfo | None = None  # who the holder is (None: it does not say)
    # Clients of its last report that have nothing waiting or in flight now, with their progress (wanted 0): for the
    # holders view's last word on them only; nothing is shared by it.
    ended: tuple[ModelDemand, ...] = ()


def loading_report(holder: str, model: str, clients: Iterable[tuple[str, int]],
                   info: HolderInfo | None = None) -> DemandReport:
    """A holder's report before it runs anything: the clients it is about to run on `model`, each still loading
    (with the most it may send), as an announcement: their share is kept free for it, and it is leased nothing
    until its lease client reports. `fedpool eval run` sends it as soon as it has checked its specs, so processes
    started together are known to the broker before the first of them sends (federation/gateway/pool.py `expect`)."""
    return DemandReport(holder=holder, announce=True, info=info, models=(ModelDemand(model=model, clients=tuple(
        ClientDemand(client=name, wanted=wanted, loading=True) for name, wanted in clients if wanted > 0)),))
