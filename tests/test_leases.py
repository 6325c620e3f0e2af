"""The capacity lease broker (registry/leases.py), on an explicit clock: how slots are shared among processes."""

from __future__ import annotations

import pytest

from fedpool.federation.core.clientbook import ClientBook
from fedpool.federation.core.ledger import InflightLedger
from fedpool.federation.core.types import Endpoint, InferenceRequest
from fedpool.federation.routing.horizon import kind_costs
from fedpool.registry import (
    ClientDemand,
    DemandReport,
    Engine,
    LeaseBroker,
    LeaseServer,
    ModelDemand,
    Served,
    ServerEntry,
    ServerRecord,
    ServerStatus,
    loading_report,
)
from fedpool.registry.api import lease_from_json, lease_json
from fedpool.registry.fills import level_fill
from fedpool.registry.leases import UNIT_SEP, holders_of, learns_at_start, unit
from fedpool.registry.placement import whole


class Broker:
    """A broker over two 4-slot servers of model m (and one of model x), driven by reports on an explicit clock."""

    def __init__(self, *, restarted: bool = False, ttl_s: float = 3.0):
        self.now = 100.0
        self.broker = LeaseBroker(lambda: self.now, ttl_s=ttl_s, restarted=restarted)
        self.broker.set_servers([LeaseServer("s0", "m", 4), LeaseServer("s1", "m", 4), LeaseServer("x0", "x", 2)])

    def report(self, holder: str, clients: dict[str, tuple[int, float]] | None = None, *,
               inflight: dict[str, int] | None = None, held: dict[str, int] | None = None, model: str = "m",
               weights: dict[str, float] | None = None, loading: frozenset[str] = frozenset(),
               work_left: dict[str, float] | None = None) -> dict[str, int]:
        """Report `clients` (name -> (wanted, rank)); `held` defaults to the lease it has (it adopted it);
        `loading`: those clients are still reading their samples; `work_left`: what those clients say they have
        left."""
        demand = ModelDemand(model=model, clients=tuple(
            ClientDemand(client=c, wanted=w, rank=r, weight=(weights or {}).get(c, 1.0), loading=c in loading,
                         work_left=(work_left or {}).get(c))
            for c, (w, r) in (clients or {}).items()))
        self.broker.report(DemandReport(
            holder=holder, models=(demand,) if clients else (), inflight=inflight or {},
            held=held if held is not None else dict(self.broker.lease(holder).slots), broker=self.broker.incarnation))
        self.broker.reshare()
        return dict(self.broker.lease(holder).slots)

    def slots(self, holder: str) -> dict[str, int]:
        return dict(self.broker.lease(holder).slots)


def total(slots: dict[str, int]) -> int:
    return sum(slots.values())


def test_one_holder_gets_what_it_wants_spread_over_the_servers_and_an_idle_one_holds_nothing() -> None:
    b = Broker()
    assert b.report("a", {"eval": (20, 0.0)}) == {"s0": 4, "s1": 4}  # all of model m, none of x
    # Wanting 2 it keeps the rest as headroom (nobody else wants it: a burst needs no round trip).
    assert b.report("a", {"eval": (2, 0.0)}, inflight={"s0": 1, "s1": 1}) == {"s0": 4, "s1": 4}
    assert b.report("a", {}) == {}  # nothing waiting or in flight: nothing held
    assert b.report("idle", {}) == {}


def test_shortest_first_across_processes_gives_the_least_work_left_every_slot_it_can_use() -> None:
    b = Broker()
    b.report("long", {"big": (40, 900.0)})
    assert total(b.slots("long")) == 8
    # A short eval starts in another process. The long one must let slots go first (its requests in flight
    # cannot be taken back): the newcomer gets nothing yet, the long one's lease shrinks.
    assert b.report("short", {"small": (10, 50.0)}) == {}
    assert b.slots("long") == {}
    # The long process hears of it and still has 8 in flight: held for it until they finish.
    b.report("long", {"big": (40, 900.0)}, inflight={"s0": 4, "s1": 4}, held={})
    assert b.report("short", {"small": (10, 50.0)}) == {}
    b.report("long", {"big": (37, 900.0)}, inflight={"s0": 2, "s1": 3}, held={})
    assert b.report("short", {"small": (10, 50.0)}) == {"s0": 2, "s1": 1}
    b.report("long", {"big": (32, 900.0)}, inflight={}, held={})
    assert b.report("short", {"small": (10, 50.0)}) == {"s0": 4, "s1": 4}
    # Once the short eval is down to what it has in flight, the rest goes back to the long one — once the short
    # one has adopted its smaller lease (it hears of it on its next report).
    shrunk = b.report("short", {"small": (3, 50.0)}, inflight={"s0": 2, "s1": 1})
    assert total(shrunk) == 3 and total(b.report("long", {"big": (32, 900.0)})) == 0
    b.report("short", {"small": (3, 50.0)}, inflight={"s0": 2, "s1": 1})
    assert total(b.report("long", {"big": (32, 900.0)})) == 5


def test_an_eval_still_loading_its_samples_shares_the_first_class_of_the_order() -> None:
    # Four evals started together in four processes (the fair order): the first to load has every slot only
    # until the others say they are loading; each then holds a quarter, as in one process.
    b = Broker()
    assert total(b.report("p0", {"long_a": (40, 0.0)})) == 8
    for holder in ("p1", "p2", "p3"):
        b.report(holder, {holder: (64, 0.0)}, loading=frozenset({holder}))
    b.report("p0", {"long_a": (40, 0.0)})
    assert [total(b.report(h, {h: (64, 0.0)}, loading=frozenset({h}))) for h in ("p1", "p2", "p3")] == [2, 2, 2]
    assert total(b.slots("p0")) == 2
    # Under shortest_first its rank says nothing yet: it shares the first class (here the short eval's), ahead of
    # the long eval, and behind nobody.
    s = Broker()
    s.report("long", {"big": (40, 900.0)})
    s.report("short", {"small": (40, 50.0)}, inflight={})
    s.report("long", {"big": (40, 900.0)})
    assert total(s.report("short", {"small": (40, 50.0)})) == 8 and total(s.slots("long")) == 0
    s.report("new", {"fresh": (64, 0.0)}, loading=frozenset({"fresh"}))
    s.report("short", {"small": (40, 50.0)})
    assert total(s.report("new", {"fresh": (64, 0.0)}, loading=frozenset({"fresh"}))) == 4
    assert total(s.slots("short")) == 4 and total(s.slots("long")) == 0
    # Loaded, it reports its work left: the order decides again (here it has more left than the short eval).
    s.report("new", {"fresh": (64, 300.0)})
    s.report("short", {"small": (40, 50.0)})
    assert total(s.report("new", {"fresh": (64, 300.0)})) == 0 and total(s.slots("short")) == 8


def test_equal_ranks_share_by_weight_and_never_more_than_the_capacity() -> None:
    b = Broker()
    b.report("a", {"ea": (40, 0.0)}, weights={"ea": 3.0})
    b.report("b", {"eb": (40, 0.0)})
    for _ in range(2):  # each adopts what it was given in turn; shares settle at 3:1 by the third round
        b.report("a", {"ea": (40, 0.0)}, weights={"ea": 3.0})
        b.report("b", {"eb": (40, 0.0)})
    a = b.report("a", {"ea": (40, 0.0)}, weights={"ea": 3.0})
    bb = b.report("b", {"eb": (40, 0.0)})
    assert (total(a), total(bb)) == (6, 2)
    for server in ("s0", "s1"):
        assert a.get(server, 0) + bb.get(server, 0) <= 4


def test_whole_slots_go_to_the_holders_nearest_their_end_and_then_to_those_holding_them() -> None:
    third = 8 / 3
    # By name alone the spare slots went to a and b; z says it has least work left.
    assert whole({"a": third, "b": third, "z": third}, {"a": 5000.0, "b": 4800.0, "z": 300.0}) == {
        "a": 3.0, "b": 2.0, "z": 3.0}
    # Work left is compared by factors of two: b's lead over a within one is no reason to move a slot a holds.
    assert whole({"a": third, "b": third, "z": third}, {"a": 3100.0, "b": 3000.0, "z": 300.0},
                 held={"a": 3, "b": 2, "z": 3}) == {"a": 3.0, "b": 2.0, "z": 3.0}
    assert whole({"a": third, "b": third, "z": third}, {"a": 3100.0, "b": 1000.0, "z": 300.0},
                 held={"a": 3, "b": 2, "z": 3}) == {"a": 2.0, "b": 3.0, "z": 3.0}
    # Unequal remainders still go by largest remainder first; holders that say nothing come last among equals.
    assert whole({"a": 2.75, "b": 2.25, "z": 3.0}, {"b": 1.0}) == {"a": 3.0, "b": 2.0, "z": 3.0}
    assert whole({"a": 1.5, "b": 1.5}, {"b": 10.0}) == {"a": 1.0, "b": 2.0}


def test_a_short_eval_tied_with_two_long_ones_gets_the_slot_rounding_leaves_over() -> None:
    """Three processes under `fair` (one class) share 8 slots as 3, 3 and 2: the short eval's process gets one of
    the 3s. Rounded by name, z's short eval kept 2 while the long ones took 3 each (multiprocess.md: arith 1.24x
    its one-process time after capitals ended)."""
    b = Broker()
    left = {"la": 5000.0, "lb": 4800.0, "short": 300.0}
    holders = {"a": "la", "b": "lb", "z": "short"}
    got: dict[str, dict[str, int]] = {}
    for _ in range(3):  # each adopts what it was given in turn
        for holder, client in holders.items():
            got[holder] = b.report(holder, {client: (40, 0.0)}, work_left={client: left[client]})
    assert total(got["z"]) == 3 and sum(total(slots) for slots in got.values()) == 8
    for server in ("s0", "s1"):
        assert sum(slots.get(server, 0) for slots in got.values()) <= 4
    first = {h: total(slots) for h, slots in got.items()}
    left.update(la=3100.0, lb=3000.0)  # the long ones' work left crosses within a factor of two: nothing moves
    for _ in range(2):
        for holder, client in holders.items():
            got[holder] = b.report(holder, {client: (40, 0.0)}, work_left={client: left[client]})
    assert {h: total(slots) for h, slots in got.items()} == first


def test_a_process_that_announced_its_evals_holds_their_share_before_it_connects() -> None:
    """`eval run` announces its evals (loading) as soon as its specs are checked: a process that finished starting
    first and asks for every slot gets its share, not the slots of one still starting (announced: loading)."""
    b = Broker()
    b.broker.report(loading_report("late", "m", [("arith", 64), ("nothing", 0)]))
    b.broker.reshare()
    assert b.slots("late") == {}  # an announcement is leased nothing: it cannot use a lease yet
    for _ in range(2):  # (its lease client has not reported yet: the announcement stands until its TTL)
        b.report("first", {"long": (40, 0.0)})
    first = b.report("first", {"long": (40, 0.0)})
    assert total(first) == 4  # the other 4 are kept for the announced eval
    late = b.report("late", {"arith": (60, 0.0)})  # its lease client's first report, as a holder
    assert total(late) == 4
    assert loading_report("x", "m", [("a", 0)]).models[0].clients == ()


def test_capacity_nobody_wants_goes_to_whoever_wants_something() -> None:
    b = Broker()
    b.report("a", {"ea": (2, 0.0)})
    b.report("b", {"eb": (1, 0.0)})
    a, bb = b.report("a", {"ea": (2, 0.0)}), b.report("b", {"eb": (1, 0.0)})
    assert total(a) + total(bb) == 8 and total(a) >= 2 and total(bb) >= 1  # headroom for bursts, no slot idle


def test_a_holder_that_stops_reporting_loses_its_slots_after_the_ttl_and_its_fallback() -> None:
    """A silent holder shares no more after a TTL; the slots it may still use as its fallback (one more TTL: the
    lease client keeps what it held, capped by its safe share) go to the others once that has run out too."""
    b = Broker(ttl_s=3.0)
    b.report("dead", {"e": (40, 0.0)})
    assert total(b.slots("dead")) == 8
    assert b.report("alive", {"f": (40, 0.0)}) == {}
    b.now += 2.0
    assert not b.broker.expire()  # within its TTL: still its
    b.report("alive", {"f": (40, 0.0)})
    b.now += 1.5
    assert b.broker.expire() and b.broker.holders() == ["alive"]
    assert b.report("alive", {"f": (40, 0.0)}) == {}  # (its fallback may be in use)
    b.now += 2.6
    assert b.broker.expire()
    assert b.report("alive", {"f": (40, 0.0)}) == {"s0": 4, "s1": 4}


def test_a_restarted_broker_learns_for_two_ttls_and_grants_nobody_more_than_it_holds() -> None:
    b = Broker(restarted=True, ttl_s=3.0)
    # A holder of the previous incarnation reports the 6 slots it holds; a newcomer wants everything.
    b.broker.report(DemandReport(holder="old", models=(ModelDemand(model="m", clients=(
        ClientDemand(client="e", wanted=40),)),), held={"s0": 3, "s1": 3}, broker="previous"))
    b.broker.reshare()
    assert b.slots("old") == {"s0": 3, "s1": 3}  # echoed, not grown
    assert b.report("new", {"f": (40, 0.0)}) == {}  # unknown leases may be in use: nothing for newcomers yet
    b.now += 3.1
    # The old incarnation's leases have run out, but a holder that never reached this one may still work within
    # its fallback (one more TTL).
    assert b.report("new", {"f": (40, 0.0)}) == {}
    b.now += 3.0
    b.broker.reshare()
    assert total(b.report("new", {"f": (40, 0.0)})) > 0


def test_a_registry_restarted_with_or_without_saved_state_learns() -> None:
    assert learns_at_start(saved_state=True, reconstructed=False)
    assert learns_at_start(saved_state=False, reconstructed=True)  # (Ray restarted it; its state was not saved)
    assert not learns_at_start(saved_state=False, reconstructed=False)  # a pool started afresh


def test_safe_shares_divide_each_server_among_its_holders_within_their_leases() -> None:
    b = Broker()
    b.report("a", {"e": (40, 0.0)})
    b.report("b", {"f": (40, 0.0)})
    b.report("c", {"g": (1, 0.0)}, model="x")
    assert b.broker.safe_shares() == {"s0": 2, "s1": 2, "x0": 2}
    b.broker.set_servers([LeaseServer("s0", "m", 4), LeaseServer("s1", "m", 0)])  # s1 went down
    b.broker.reshare()
    assert b.broker.safe_shares() == {"s0": 2}


def test_the_fallbacks_of_holders_outnumbering_the_slots_add_up_to_at_most_the_slots() -> None:
    """Each lease's fallback is the lease capped at the capacity ÷ the holders: never a slot the lease does not
    hold (a slot each for 10 holders of 8 slots was 10)."""
    b = Broker()
    for i in range(10):
        b.report(f"h{i}", {f"e{i}": (40, 0.0)})
    for i in range(10):
        b.report(f"h{i}", {f"e{i}": (40, 0.0)})
    safe = [b.broker.lease(f"h{i}").safe for i in range(10)]
    for sid in ("s0", "s1"):
        assert sum(s.get(sid, 0) for s in safe) <= 4
    for i, s in enumerate(safe):
        slots = b.slots(f"h{i}")
        assert all(n <= slots.get(sid, 0) for sid, n in s.items())


def test_service_ranks_are_put_on_one_scale_across_holders() -> None:
    """Clients ranked by service (shortest_first, no work left reported) are compared by slot-seconds on the
    scale of every holder's answers: ranked on each holder's own scale, a client of a process whose answers
    happened to be long-prompt (much work per slot-second) would queue behind one that had twice its service."""
    b = Broker()

    def report(holder: str, client: str, served_s: float, work: float, slot_s: float, rank: float) -> None:
        demand = ModelDemand(model="m", clients=(ClientDemand(client=client, wanted=8, rank=rank, served_s=served_s),))
        b.broker.report(DemandReport(holder=holder, models=(demand,), served_work=work, served_slot_s=slot_s,
                                     broker=b.broker.incarnation))

    # Own scales: a's answers 1000 work per slot-second, b's 100. Ranked on them, a's tool (10 slot-s of service)
    # would be 10,000 and b's (20 slot-s) 2,000: b's first though it has had twice the service.
    report("a", "tool-a", 10.0, work=10_000.0, slot_s=10.0, rank=10_000.0)
    report("b", "tool-b", 20.0, work=2_000.0, slot_s=20.0, rank=2_000.0)
    b.broker.reshare()
    assert total(b.slots("a")) == 8 and b.slots("b") == {}


def test_a_process_with_no_answer_yet_prices_its_callers_by_every_holder_s_answers() -> None:
    """Two gateway replicas start together: gw-short's caller asks for 4-token answers and has had some; gw-long's
    asks for 64 and has had none, so its process knew no seconds to price them by (its 3 in flight counted 0) and
    the broker shared the slots evenly for as long as its first answer took (~5 s of an 8 s lm-eval run on
    llama.cpp). The broker sums every holder's answers into each lease; priced by them, the long-answer caller's
    requests in flight rank it behind the short one, and the short one gets the slots."""
    b = Broker()
    ledgers = {name: InflightLedger(clock=lambda: 0.0, wall_clock=lambda: 0.0) for name in ("gw-short", "gw-long")}
    books = {name: ClientBook("shortest_first", ledger) for name, ledger in ledgers.items()}

    def report(holder: str, client: str, max_tokens: int) -> None:
        book = books[holder]
        book.note_request(client, InferenceRequest.from_body(
            {"prompt": "x" * 80, "max_tokens": max_tokens}, request_id=client, model="m",
            endpoint=Endpoint.COMPLETIONS), 0.0)
        served = book.served_totals()
        demand = ModelDemand(model="m", clients=(ClientDemand(client=client, wanted=8, rank=book.first(client),
                                                              served_s=book.served_s(client)),))
        b.broker.report(DemandReport(holder=holder, models=(demand,), served_work=served.work,
                                     served_slot_s=served.slot_s, served_answer_tokens=served.answer_tokens,
                                     held=b.slots(holder), broker=b.broker.incarnation))
        b.broker.reshare()
        book.pool_served = lease_from_json(lease_json(b.broker.lease(holder))).pool_served  # (over the HTTP API)

    short_slot, long_slot = ledgers["gw-short"].slots("s0"), ledgers["gw-long"].slots("s1")
    for _ in range(4):
        ledgers["gw-short"].take(short_slot, "arith")
    ledgers["gw-short"].release(short_slot, "arith")
    books["gw-short"].note_served("arith", 60, 3, 0.47)  # one 3-token answer held its slot 0.47 s
    for _ in range(3):
        ledgers["gw-long"].take(long_slot, "long")
    long = books["gw-long"]
    report("gw-long", "long", 64)  # priced by nothing yet: no seconds, ranked by its shape
    assert long.expected_s("long") == 0.0 and long.served_s("long") is None
    report("gw-short", "arith", 4)
    assert b.broker.lease("gw-long").pool_served == Served(60.0 + 2 * 3, 0.47, 3.0)
    assert total(b.slots("gw-short")) < 8  # (ranked on gw-long's 0 s, arith is not behind)
    for _ in range(3):  # each adopts its lease and reports again; the first brought gw-long the pool's figures
        report("gw-long", "long", 64)
        report("gw-short", "arith", 4)
    assert long.expected_s("long") == pytest.approx(64 * 0.47 / 3)
    assert long.served_s("long") == pytest.approx(3 * 64 * 0.47 / 3)  # 30 slot-s against arith's 3 × 0.47 + 0.47
    assert total(b.slots("gw-short")) == 8 and b.slots("gw-long") == {}


def test_before_any_answer_anywhere_two_replicas_callers_are_ranked_by_their_requests_shapes() -> None:
    """Two gateway replicas' callers start together and nothing has been answered anywhere: no seconds to count
    service in (each would read 0 s, and they shared the slots 4 and 4), so each is ranked by its requests' shapes
    (prompt + 2 × answer budget), as one gateway ranks them: the caller asking for 4-token answers gets all 8 slots
    and the one asking for 64 none, until answers give them seconds (its requests in flight, first sent, give
    their slots back at their first token: tests/test_preempt.py)."""
    b = Broker()
    ledgers = {name: InflightLedger(clock=lambda: 0.0, wall_clock=lambda: 0.0) for name in ("gw-short", "gw-long")}
    books = {name: ClientBook("shortest_first", ledger) for name, ledger in ledgers.items()}
    for ledger, client in zip(ledgers.values(), ("arith", "long"), strict=True):
        slot = ledger.slots("s0")
        for _ in range(4):  # the first lease split the slots 4 and 4
            ledger.take(slot, client)

    def report(holder: str, client: str, max_tokens: int) -> None:
        book = books[holder]
        book.note_request(client, InferenceRequest.from_body(
            {"prompt": "x" * 80, "max_tokens": max_tokens}, request_id=client, model="m",
            endpoint=Endpoint.COMPLETIONS), 0.0)
        assert book.served_s(client) is None  # (nothing answered anywhere)
        demand = ModelDemand(model="m", clients=(ClientDemand(client=client, wanted=8, rank=book.first(client),
                                                              served_s=book.served_s(client)),))
        b.broker.report(DemandReport(holder=holder, models=(demand,), held=b.slots(holder),
                                     broker=b.broker.incarnation))
        b.broker.reshare()

    for _ in range(3):  # each adopts its lease and reports again
        report("gw-long", "long", 64)
        report("gw-short", "arith", 4)
    assert total(b.slots("gw-short")) == 8 and b.slots("gw-long") == {}


def test_two_holders_each_spread_over_both_servers_not_one_server_each() -> None:
    """Two processes with equal demand each get half of every server: a lease that kept the first slots it held
    put one gateway replica's requests all on one server and the other's on the other (idle slots it held beyond
    its fair spread now go back, and dealt slots go where the holder is under it)."""
    b = Broker()
    assert b.report("a", {"eval-a": (4, 1.0)}) == {"s0": 4, "s1": 4}  # alone: all of it, as headroom
    b.report("b", {"eval-b": (4, 1.0)})
    for _ in range(3):  # each hears of the other and lets slots go; the broker deals them again
        b.report("a", {"eval-a": (4, 1.0)})
        b.report("b", {"eval-b": (4, 1.0)})
    assert b.slots("a") == {"s0": 2, "s1": 2} and b.slots("b") == {"s0": 2, "s1": 2}
    # Slots in flight are kept where they are (they cannot be taken back), whatever the spread.
    assert b.report("a", {"eval-a": (4, 1.0)}, inflight={"s0": 2}) == {"s0": 2, "s1": 2}


def test_clients_ranked_by_service_share_while_near_equal_and_one_far_behind_goes_first() -> None:
    """Two gateway replicas' callers, each ranked by the service it has attained: ranked strictly, the one a hair
    behind got all 8 slots and the other none, until whole requests later the ranks swapped (5-11 s without a
    slot). Within SERVICE_TIE_S seconds of an equal share (2 s × 4 slots = 8 slot-seconds here) they share; a
    caller far behind (a newcomer) still goes first."""
    b = Broker()

    def report(holder: str, client: str, served_s: float) -> dict[str, int]:
        demand = ModelDemand(model="m", clients=(ClientDemand(client=client, wanted=8, served_s=served_s),))
        b.broker.report(DemandReport(holder=holder, models=(demand,), served_work=100.0, served_slot_s=10.0,
                                     held=dict(b.broker.lease(holder).slots), broker=b.broker.incarnation))
        b.broker.reshare()
        return b.slots(holder)

    for _ in range(3):  # each adopts its lease and reports again
        report("gw0", "arith", 30.0)
        report("gw1", "long", 36.0)  # 6 slot-seconds ahead: near equal
    assert b.slots("gw0") == {"s0": 2, "s1": 2} and b.slots("gw1") == {"s0": 2, "s1": 2}
    for _ in range(3):
        report("gw0", "arith", 30.0)
        report("gw1", "long", 39.0)  # 9 slot-seconds ahead: arith is behind by more than the tie
    assert total(b.slots("gw0")) == 8 and b.slots("gw1") == {}


def test_callers_that_say_what_a_request_adds_share_by_levels_of_service_as_one_gateway_serves_them() -> None:
    """Two gateway replicas' callers ranked by service, each saying the slot-seconds one of its requests holds
    (arith 1 s, long 7 s) and its requests in flight. One gateway gives each free slot to the caller least served
    so far, so the short caller holds about 7 of 8 slots while both have had nothing; the broker shares by the same
    levels (a tie class gave 4 and 4: the short lm-eval run took 1.2-1.5x as long behind its own replica). Levels
    move continuously: two callers a hair apart share nearly evenly, and a caller far behind goes first."""
    b = Broker()

    def report(holder: str, client: str, served_s: float, request_s: float, running: int) -> dict[str, int]:
        demand = ModelDemand(model="m", clients=(ClientDemand(client=client, wanted=8, served_s=served_s,
                                                              request_s=request_s, running=running),))
        b.broker.report(DemandReport(holder=holder, models=(demand,), served_work=100.0, served_slot_s=10.0,
                                     held=dict(b.broker.lease(holder).slots), broker=b.broker.incarnation))
        b.broker.reshare()
        return b.slots(holder)

    for _ in range(3):  # each adopts its lease and reports again (nothing answered yet: its level is what it runs)
        report("gw0", "arith", 0.0, 1.0, 0)
        report("gw1", "long", 0.0, 7.0, 0)
    assert total(b.slots("gw0")) == 7 and total(b.slots("gw1")) == 1
    for _ in range(3):  # equal requests, 0.5 slot-seconds apart: nearly even, never all to one
        report("gw0", "arith", 30.5, 1.0, 4)
        report("gw1", "long", 31.0, 1.0, 4)
    assert total(b.slots("gw0")) == 4 and total(b.slots("gw1")) == 4
    for _ in range(3):  # long far ahead (a newcomer's arith far behind): arith first, up to what it wants
        report("gw0", "arith", 4.0, 1.0, 4)
        report("gw1", "long", 60.0, 1.0, 4)
    assert total(b.slots("gw0")) == 8 and b.slots("gw1") == {}


def test_before_any_answer_anywhere_callers_share_by_their_requests_steps_and_keep_them_as_counts_change() -> None:
    """Nothing answered anywhere: each replica's caller says what one of its requests takes by its shape (its
    decode steps: a 6-shot prompt with a 4-token answer 5, a short prompt with a 48-token one 49) and the broker
    shares by levels from 0 — about 7 of 8 slots to the short caller, whatever each has in flight. Ranked by its
    shape × its requests in flight instead, the short caller passed behind once it ran 7 and back once it ran
    fewer, and every pass cancelled one caller's young attempts (16-34 per llama.cpp server in one lm-eval run)."""
    b = Broker()
    ledgers = {name: InflightLedger(clock=lambda: 0.0, wall_clock=lambda: 0.0) for name in ("gw-short", "gw-long")}
    books = {name: ClientBook("shortest_first", ledger) for name, ledger in ledgers.items()}
    shapes = {"gw-short": ("arith", "x" * 256, 4), "gw-long": ("long", "x" * 80, 48)}

    def report(holder: str) -> dict[str, int]:
        book = books[holder]
        client, prompt, max_tokens = shapes[holder]
        book.note_request(client, InferenceRequest.from_body(
            {"prompt": prompt, "max_tokens": max_tokens}, request_id=client, model="m",
            endpoint=Endpoint.COMPLETIONS), 0.0)
        request_s, running = book.request_s(client)
        assert book.served_s(client) is None and request_s is not None  # (no seconds anywhere: its shape's steps)
        demand = ModelDemand(model="m", clients=(ClientDemand(client=client, wanted=8, rank=book.first(client),
                                                              request_s=request_s, running=running),))
        b.broker.report(DemandReport(holder=holder, models=(demand,), held=b.slots(holder),
                                     broker=b.broker.incarnation))
        b.broker.reshare()
        return b.slots(holder)

    assert books["gw-short"].request_s("arith") == (None, 0)  # (nothing known of it yet)
    for running in (0, 7, 1, 4):  # its requests in flight change; its share does not
        slot = ledgers["gw-short"].slots("s0")
        while ledgers["gw-short"].of_client("arith") < running:
            ledgers["gw-short"].take(slot, "arith")
        while ledgers["gw-short"].of_client("arith") > running:
            ledgers["gw-short"].release(slot, "arith")
        for _ in range(2):
            report("gw-long")
            report("gw-short")
        assert total(b.slots("gw-short")) == 7 and total(b.slots("gw-long")) == 1


@pytest.mark.parametrize("capacity", [0.0, 1.0, 5.5, 8.0, 30.0])
def test_level_fill_gives_out_the_capacity_lowest_levels_first_each_up_to_what_it_wants(capacity: float) -> None:
    clients = [(0.0, "a", 1.0, 8.0, 1.0), (0.0, "b", 1.0, 8.0, 7.0), (3.0, "c", 2.0, 4.0, 1.0),
               (100.0, "d", 1.0, 8.0, 1.0)]
    got = level_fill(clients, capacity)
    assert sum(got) == pytest.approx(min(capacity, sum(c[3] for c in clients)))
    assert all(0.0 <= g <= c[3] + 1e-9 for g, c in zip(got, clients, strict=True))
    if 0 < capacity < 28:  # a client at a higher level than another's reaches gets nothing
        assert got[3] == 0.0
        levels = [c[0] + g * c[4] / c[2] for g, c in zip(got, clients, strict=True) if 0 < g < c[3]]
        assert max(levels) - min(levels) == pytest.approx(0.0, abs=1e-6)  # those not capped stand level


def test_a_holder_in_flight_beyond_its_share_keeps_its_fair_spread_of_them_on_each_server() -> None:
    """A gateway replica alone had all 8 slots in flight, 4 on each server; another replica's caller comes and
    they share. The first keeps 2 on each server (the rest it gives back, its youngest at once), not the 4 on the
    server it reports first: keeping those put every one of its callers' requests on one server (76% of all)."""
    b = Broker()
    b.report("gw0", {"arith": (8, 1.0)}, inflight={"s0": 4, "s1": 4})
    b.report("gw1", {"long": (8, 1.0)})
    assert b.report("gw0", {"arith": (8, 1.0)}, inflight={"s0": 4, "s1": 4}) == {"s0": 2, "s1": 2}
    b.report("gw0", {"arith": (8, 1.0)}, inflight={"s0": 2, "s1": 2})
    assert b.report("gw1", {"long": (8, 1.0)}) == {"s0": 2, "s1": 2}


def test_a_lease_sent_but_not_yet_acknowledged_is_not_room_for_another_holder() -> None:
    """A holder is granted all 8 slots and fills them before its next report (twice a second). Meanwhile two more
    holders report: its lease shrinks, and shrinks again. Its last report predates every lease it was sent, so the
    broker may not take its smaller current lease as what it uses: the 8 slots it was first sent stay taken until
    it reports what it holds and has in flight (the engines queued 2-3 requests beyond their slots for 6 s)."""
    b = Broker()

    def report(holder: str, known: int, inflight: dict[str, int] | None = None) -> None:
        demand = ModelDemand(model="m", clients=(ClientDemand(client=holder, wanted=40, rank=1.0),))
        b.broker.report(DemandReport(holder=holder, models=(demand,), inflight=inflight or {},
                                     held=dict(b.broker.lease(holder).slots) if known > 0 else {},
                                     broker=b.broker.incarnation), known_version=known)
        b.broker.reshare()

    report("a", -1)
    assert b.slots("a") == {"s0": 4, "s1": 4} and b.broker.version("a") == 1  # it sends 8 requests at once
    report("b", -1)
    report("c", -1)
    assert b.broker.version("a") >= 2 and total(b.slots("a")) < 8  # a's share shrank, a has not heard yet
    assert b.slots("b") == {} and b.slots("c") == {}  # what a was sent may all be in use
    report("a", b.broker.version("a"), inflight={"s0": 4, "s1": 4})  # it has: 8 in flight
    assert b.slots("b") == {} and b.slots("c") == {}
    report("a", b.broker.version("a"), inflight={"s0": 1, "s1": 2})  # 5 of them ended
    for _ in range(3):  # each hears of its lease and says it holds it
        for holder in ("a", "b", "c"):
            report(holder, b.broker.version(holder), inflight={"s0": 1, "s1": 2} if holder == "a" else None)
    lease_a = b.slots("a")  # (what a may still use: the lease it holds, or its requests in flight)
    for sid, in_flight in (("s0", 1), ("s1", 2)):  # every slot used once, none idle
        assert max(lease_a.get(sid, 0), in_flight) + b.slots("b").get(sid, 0) + b.slots("c").get(sid, 0) == 4


def test_slots_are_placed_on_the_kinds_each_holder_s_work_suits() -> None:
    """Two kinds (a fast one of 8 slots, a slow one of 8): each holder's requests go where the min-makespan split
    of both holders' work puts them (placement.plan_requests) — by their costs there, not by capacity alone (each
    half on each)."""
    b = LeaseBroker(lambda: 100.0, restarted=False)
    b.set_servers([LeaseServer("a0", "m", 4, "A100x1/4"), LeaseServer("a1", "m", 4, "A100x1/4"),
                   LeaseServer("v0", "m", 4, "V100x1/4"), LeaseServer("v1", "m", 4, "V100x1/4")])

    def report(holder: str, costs: dict[str, float]) -> None:
        demand = ModelDemand(model="m", clients=(ClientDemand(client=holder, wanted=40),), kind_costs=costs)
        b.report(DemandReport(holder=holder, models=(demand,), held=dict(b.lease(holder).slots),
                              broker=b.incarnation))

    for _ in range(2):  # (each adopts its lease in turn)
        report("captions", {"A100x1/4": 0.2, "V100x1/4": 0.5})
        report("long-answers", {"A100x1/4": 3.0, "V100x1/4": 7.0})
        b.reshare()
    # By comparative advantage (a caption costs 2.5× as much on the slow kind, a long answer 2.3×: the min-makespan
    # split puts the captions on the fast kind, the long answers on both), not by capacity alone.
    assert dict(b.lease("captions").slots) == {"a0": 2, "a1": 2}
    assert dict(b.lease("long-answers").slots) == {"a0": 2, "a1": 2, "v0": 4, "v1": 4}
    for _ in range(2):  # long answers that cost 3× as much on the slow kind: the captions take it
        report("captions", {"A100x1/4": 0.2, "V100x1/4": 0.3})
        report("long-answers", {"A100x1/4": 3.0, "V100x1/4": 9.0})
        b.reshare()
    assert set(b.lease("captions").slots) <= {"v0", "v1"}
    assert {"a0": 4, "a1": 4}.items() <= dict(b.lease("long-answers").slots).items()


def test_no_holder_is_placed_on_a_kind_where_its_requests_would_outlast_the_horizon() -> None:
    """The horizon rule of one process (federation/routing/horizon.py) across processes: few requests left everywhere, a
    slow kind's price for long answers is past (1 - margin) × the pool's horizon, so their holder gets no slot there
    — the slow kind sits the tail out — while short requests may still go there."""
    b = LeaseBroker(lambda: 100.0, restarted=False)
    b.set_servers([LeaseServer("a0", "m", 4, "A100x1/4"), LeaseServer("v0", "m", 4, "V100x1/4"),
                   LeaseServer("v1", "m", 4, "V100x1/4")])

    def report(holder: str, wanted: int, costs: dict[str, float], left: int | None = -1) -> dict[str, int]:
        client = ClientDemand(client=holder, wanted=wanted, requests_left=wanted if left == -1 else left)
        demand = ModelDemand(model="m", clients=(client,), kind_costs=costs)
        b.report(DemandReport(holder=holder, models=(demand,), held=dict(b.lease(holder).slots),
                              broker=b.incarnation))
        b.reshare()
        return dict(b.lease(holder).slots)

    # Two long answers left (3 s on the fast kind, 7 s on the slow one) and 8 short requests: the horizon is about
    # (2 × 3 + 8 × 0.2) / 12 slots ≈ 0.6 s; the long answers may use only the fast kind, the short ones both.
    report("long", 2, {"A100x1/4": 3.0, "V100x1/4": 7.0})
    report("short", 8, {"A100x1/4": 0.2, "V100x1/4": 0.5})
    long_slots = report("long", 2, {"A100x1/4": 3.0, "V100x1/4": 7.0})  # the second round: each adopted its share
    short_slots = report("short", 8, {"A100x1/4": 0.2, "V100x1/4": 0.5})
    assert set(long_slots) == {"a0"} and 2 <= long_slots["a0"] <= 4
    assert sum(short_slots.values()) >= 8 and set(short_slots) >= {"v0", "v1"}
    # Alone and wanting more than the fast kind has, long answers still get no slot on the slow kind.
    b.release("short")
    b.reshare()
    assert report("long", 20, {"A100x1/4": 3.0, "V100x1/4": 7.0}) == {"a0": 4}
    # Its run is longer than what is in view (it says 200 requests are left): the slow kind cannot be its tail.
    assert set(report("long", 20, {"A100x1/4": 3.0, "V100x1/4": 7.0}, left=200)) == {"a0", "v0", "v1"}
    # Nor when it says nothing of what is left and is still sending (a gateway's streaming caller).
    report("long", 2, {"A100x1/4": 3.0, "V100x1/4": 7.0})
    assert set(report("long", 20, {"A100x1/4": 3.0, "V100x1/4": 7.0}, left=None)) == {"a0", "v0", "v1"}



def test_a_holder_s_clients_are_planned_each_on_its_own_kinds_and_summed_to_the_holder() -> None:
    """A process running several evals: the broker plans each of its clients on the kinds that client's own costs
    suit (`unit`: holder and client), then sums them to the holder — its kinds are its clients' together."""
    by_unit = {unit("p", "captions"): {"V100": 3.0}, unit("p", "long"): {"A100": 4.0, "V100": 1.0},
               unit("q", "long"): {"A100": 4.0}}
    by_kind, allowed = holders_of(by_unit, {unit("p", "long"): {"A100"}, unit("p", "captions"): {"V100"},
                                            unit("q", "long"): {"A100"}})
    assert by_kind == {"p": {"V100": 4.0, "A100": 4.0}, "q": {"A100": 4.0}}
    assert allowed == {"p": {"A100", "V100"}, "q": {"A100"}}
    # a client that may use every kind (no entry) makes its holder's kinds every kind
    assert holders_of(by_unit, {unit("p", "long"): {"A100"}})[1] == {}
    assert UNIT_SEP not in "p" and unit("p", "c").split(UNIT_SEP, 1) == ["p", "c"]


def test_each_client_s_own_kind_costs_reach_the_broker() -> None:
    """The dispatcher's report prices every client of a process on each kind (its own request shape), beside the
    mean of them all (federation/routing/horizon.py `kind_costs`)."""
    a100, v100 = (ServerEntry(record=ServerRecord(id=gpu.lower(), url=f"http://{gpu.lower()}", engine=Engine.VLLM,
                                                  model="m", accelerator=gpu, gpu_count=1),
                              status=ServerStatus.HEALTHY, capacity=16, weight=1.0) for gpu in ("A100", "V100"))
    mean, per = kind_costs([a100, v100], {"text": (10, (250.0, 384.0)), "video": (30, (7000.0, 32.0))})
    assert set(per) == {"text", "video"} and set(mean) == {a100.kind, v100.kind}
    for kind in mean:
        assert mean[kind] == pytest.approx((10 * per["text"][kind] + 30 * per["video"][kind]) / 40)
        assert per["video"][kind] > per["text"][kind]  # (7,000 prompt tokens against 250)
    assert kind_costs([a100], {"text": (10, (250.0, 384.0))}) == ({}, {})  # one kind: nothing to place
