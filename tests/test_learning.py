"""Throughput learning and adaptive admission windows, driven by an explicit clock."""

from __future__ import annotations

import pytest

from fedpool.federation.core.ledger import (
    HISTORY_S,
    BusyRate,
    InflightLedger,
    StallClock,
)
from fedpool.federation.core.windows import KV_ROOM, WindowController, WindowObservation, admissible
from fedpool.registry import LoadSample


def test_throughput_counts_busy_time_only() -> None:
    """Tokens per second of the time the ledger had work on the server; idle gaps do not count."""
    now = [0.0]
    ledger = InflightLedger(clock=lambda: now[0], wall_clock=lambda: now[0])
    rate = BusyRate(tau_s=1e9)  # no decay: the plain ratio
    ledger.take(ledger.slots("s"), "c")
    now[0] = 1.0
    ledger.release(ledger.slots("s"), "c")
    rate.add(now[0], ledger.busy_s("s"), 100)
    now[0] = 10.0  # idle from 1 to 10
    ledger.take(ledger.slots("s"), "c")
    now[0] = 11.0
    ledger.release(ledger.slots("s"), "c")
    rate.add(now[0], ledger.busy_s("s"), 100)
    assert ledger.busy_s("s") == pytest.approx(2.0)
    assert rate.value(now[0], ledger.busy_s("s")) == pytest.approx(100.0)  # 200 tokens over 2 busy seconds


def test_faster_server_learns_a_higher_rate_and_old_periods_fade() -> None:
    now = [0.0]
    ledger = InflightLedger(clock=lambda: now[0], wall_clock=lambda: now[0])
    fast, slow = BusyRate(tau_s=5.0), BusyRate(tau_s=5.0)
    for _ in range(10):
        start = now[0]
        ledger.take(ledger.slots("fast"), "c")
        ledger.take(ledger.slots("slow"), "c")
        now[0] = start + 0.5
        ledger.release(ledger.slots("fast"), "c")
        fast.add(now[0], ledger.busy_s("fast"), 40)
        now[0] = start + 1.0
        ledger.release(ledger.slots("slow"), "c")
        slow.add(now[0], ledger.busy_s("slow"), 40)
    fast_rate, slow_rate = fast.value(now[0], ledger.busy_s("fast")), slow.value(now[0], ledger.busy_s("slow"))
    assert fast_rate is not None and slow_rate is not None and fast_rate == pytest.approx(2 * slow_rate)
    # The slow server speeds up: its rate follows within a few time constants.
    for _ in range(30):
        ledger.take(ledger.slots("slow"), "c")
        now[0] += 0.5
        ledger.release(ledger.slots("slow"), "c")
        slow.add(now[0], ledger.busy_s("slow"), 40)
    assert slow.value(now[0], ledger.busy_s("slow")) == pytest.approx(80.0, rel=0.05)


def test_the_ledger_counts_each_attempt_once_per_server_client_and_pair() -> None:
    now = [0.0]
    ledger = InflightLedger(clock=lambda: now[0], wall_clock=lambda: 1000.0 + now[0])
    ledger.take(ledger.slots("a"), "x")
    ledger.take(ledger.slots("a"), "y")
    now[0] = 1.0
    ledger.take(ledger.slots("b"), "x")
    assert (ledger.on_server("a"), ledger.on_server("b"), ledger.of_client("x"), ledger.total()) == (2, 1, 2, 3)
    assert dict(ledger.clients_on("a")) == {"x": 1, "y": 1}
    now[0] = 2.0
    ledger.release(ledger.slots("a"), "x")
    ledger.release(ledger.slots("a"), "y")
    assert ledger.on_server("a") == 0 and dict(ledger.clients_on("a")) == {} and ledger.of_client("x") == 1
    assert ledger.busy_s("a") == pytest.approx(2.0) and ledger.busy_s("b") == pytest.approx(1.0)
    # The wall-clock history answers "how many did we have there at the scrape's time".
    assert ledger.at("a", 1000.5) == 2 and ledger.at("a", 1002.5) == 0 and ledger.at("a", 999.0) == 0
    # Within one bucket of wall time the history keeps the largest count (others' load is never overestimated).
    now[0] = 3.0
    ledger.take(ledger.slots("a"), "x")
    ledger.release(ledger.slots("a"), "x")
    assert ledger.at("a", 1003.0) == 1 and ledger.at("a", 1003.5) == 0
    # Past HISTORY_S the history is trimmed: before what it keeps, the largest count of its oldest bucket.
    now[0] = 3.0 + HISTORY_S + 1
    ledger.take(ledger.slots("a"), "x")
    ledger.release(ledger.slots("a"), "x")
    assert ledger.at("a", 999.0) == 1


def obs(**kw: object) -> WindowObservation:
    base: dict[str, object] = {"throughput": 100.0, "per_token_latency_s": 0.01, "scraped_waiting": 0.0,
                               "rate_limited": 0, "window_was_full": True}
    return WindowObservation(**{**base, **kw})  # type: ignore[arg-type]


def test_window_grows_while_the_engine_does_not_queue_and_shrinks_on_queueing() -> None:
    ctl = WindowController(capacity=8, window=4, max_factor=1.0)
    assert ctl.decide(obs(throughput=100)).window == 5  # at least +1
    assert ctl.decide(obs(throughput=120)).window == pytest.approx(6.25)  # then × 1.25
    d = ctl.decide(obs(throughput=120, scraped_waiting=3))  # no in-flight count given: a quarter off
    assert d.window == pytest.approx(6.25 * 0.75) and "queue" in d.reason
    assert ctl.limit == 4
    # With an exact in-flight count the window drops in one step to what the engine runs plus the allowance.
    big = WindowController(capacity=256)
    d = big.decide(obs(scraped_waiting=150, inflight=250))
    assert d.window == pytest.approx(250 - 150 + 0.05 * 256)
    # The allowance is a share of the capacity, not of the window: a queue under it no longer shrinks a
    # small window (it used to ratchet windows down under prompt-heavy load).
    assert big.decide(obs(scraped_waiting=10, inflight=100, window_was_full=False)).reason == "steady"
    assert big.decide(obs(scraped_waiting=3, inflight=100)).reason == "full window, engine not queueing"


def test_a_queue_the_engine_is_still_admitting_shrinks_no_window() -> None:
    """A queue the book finds the engine can still start (`admissible`, tests/test_preempt.py) shrinks no window, by
    the scrape's rule or the period's; at a tail the queue moves to servers with room all the same. Admissible: the
    cache has room and the batch a free slot — as many as the room takes where the cache's size and a request's
    KV are known (our part in proportion), else all; behind a full cache or a full batch, or where the engine does
    not say how full its cache is, a queue is overflow."""
    def load(running: float, waiting: float, usage: float | None) -> LoadSample:
        return LoadSample(running=running, waiting=waiting, observed_at=0.0, kv_cache_usage=usage)

    assert admissible(load(11, 245, 0.002), 256, 245) == (245, False)
    assert admissible(load(11, 245, 0.002), 256, 245, 938_192, 1_500.0) == (245, True)  # (room for ~560)
    assert admissible(load(11, 245, KV_ROOM), 256, 245) == (0.0, False)
    assert admissible(load(11, 245, KV_ROOM), 256, 245, 938_192, 1_500.0) == (0.0, True)
    assert admissible(load(256, 20, 0.3), 256, 20) == (0.0, False)
    assert admissible(load(11, 245, None), 256, 245, 938_192, 1_500.0) == (0.0, False)  # (llama.cpp: not said)
    # A V100 of the Table 7 pool: 48 running, 117 long-context prompts (~7,000 tokens) queued, its cache 85% full.
    room, measured = admissible(load(48, 117, 0.85), 256, 117, 184_848, 7_032.0)
    assert measured and room == pytest.approx(0.05 * 184_848 / 7_032)
    assert admissible(load(10, 100, 0.5), 256, 50, 1_000, 20.0) == (10.0, True)  # ours: half the queue, half the room
    ctl = WindowController(capacity=256)
    assert ctl.on_scrape(245, 256, admissible=245) is None and ctl.window == 256
    assert ctl.decide(obs(scraped_waiting=245, inflight=256, admissible=245)).window == 256
    shrunk = ctl.on_scrape(245, 256)
    assert shrunk is not None and shrunk.window == pytest.approx(256 - 245 + 0.05 * 256)
    tail = WindowController(capacity=256).on_scrape(10, 40, tail=True, admissible=10)
    assert tail is not None and tail.window == 31
    # Measured, the overflow shrinks the window though under three quarters of ours there; guessed, it does not.
    assert WindowController(capacity=256).on_scrape(117, 165, admissible=room) is None
    v100 = WindowController(capacity=256).on_scrape(117, 165, admissible=room, measured=True)
    assert v100 is not None and v100.window == pytest.approx(165 - (117 - room) + 0.05 * 256)


def test_window_shrinks_on_429_and_latency_inflation_and_respects_bounds() -> None:
    ctl = WindowController(capacity=4, inflation_limit=3.0)
    assert ctl.window == 4
    assert ctl.decide(obs()).window == 4  # already at capacity: the ceiling holds
    assert ctl.decide(obs(rate_limited=2)).window == 3
    assert ctl.decide(obs(per_token_latency_s=0.05)).reason == "latency inflation"
    for _ in range(20):
        ctl.decide(obs(rate_limited=1))
    assert ctl.limit == 1  # never below one
    assert ctl.decide(obs(window_was_full=False)).reason == "steady"


def test_a_lasting_shift_of_the_mix_becomes_the_new_latency_baseline() -> None:
    """Per-token latency jumps when long-prompt requests arrive: one shrink for the sudden inflation, then
    the new level is the baseline and the window is left alone (against the best ever seen it would
    shrink every period down to 1)."""
    ctl = WindowController(capacity=64, inflation_limit=3.0)
    for _ in range(4):
        ctl.decide(obs(per_token_latency_s=0.001))
    assert ctl.decide(obs(per_token_latency_s=0.02)).reason == "latency inflation"
    reasons = [ctl.decide(obs(per_token_latency_s=0.02)).reason for _ in range(12)]
    assert reasons[-6:].count("latency inflation") == 0 and ctl.limit >= 16
    off = WindowController(capacity=4)  # the default: off
    off.decide(obs(per_token_latency_s=0.001))
    off.decide(obs(per_token_latency_s=0.001))
    assert off.decide(obs(per_token_latency_s=9.0)).reason != "latency inflation"


def test_a_stalled_loop_is_not_charged_to_the_server() -> None:
    """The client's own loop stops for 0.2 s while an attempt is in flight and a grant pass is pending (a long
    callback, a GC pause, the process descheduled): the ledger's clock stands still from the pass's due time
    until it runs, so the server's busy time and occupancy leave the stall out. The clock never goes back and
    stays continuous when the stall is counted."""
    inner = [100.0]
    clock = StallClock(lambda: inner[0], tolerance_s=0.005)
    ledger = InflightLedger(clock=clock.now, wall_clock=lambda: inner[0])
    server = ledger.slots("s")
    ledger.take(server, "c")
    inner[0] = 100.03
    clock.pending_since = inner[0]  # a request arrives: a grant pass is asked for
    before = clock.now()
    inner[0] = 100.23  # ... and runs 0.2 s late: the loop stood still
    during = clock.now()
    assert during >= before and during - before == pytest.approx(0.005)  # it stood still, it did not go back
    assert clock.ran(inner[0]) == pytest.approx(0.2)
    assert clock.now() == pytest.approx(during)  # continuous when the stall is counted
    assert clock.stalled_s == pytest.approx(0.195) and clock.stalls == 1
    inner[0] = 100.26
    ledger.release(server, "c")
    # in flight 0.26 s of monotonic time, of which 0.195 s stalled: charged 0.065 s
    assert ledger.occupancy_s("s") == pytest.approx(0.065)
    assert ledger.busy_s("s") == pytest.approx(ledger.occupancy_s("s"))  # one attempt: the same seconds
    # A pass that runs on time is no stall.
    clock.pending_since = inner[0]
    inner[0] += 0.001
    assert clock.ran(inner[0]) == pytest.approx(0.001) and clock.stalls == 1


def test_a_speed_no_answer_renews_fades_back_to_the_prior() -> None:
    """Two equal servers; one measured 4× slower in a slow spell and then given nothing (the other's expected
    wait always lower) must not keep that one measurement for good: after two learning periods without an
    answer its weight fades toward the prior on the learned scale, and a new answer measures it again at once
    (speeds are renewed by each answer, not at a period's close)."""
    from fedpool.federation.core.serverbook import BookSettings, ServerBook, ServerState
    from fedpool.registry import Engine, PoolSnapshot, ServerEntry, ServerRecord, ServerStatus, prior_weight

    now = [0.0]
    ledger = InflightLedger(clock=lambda: now[0], wall_clock=lambda: now[0])
    book = ServerBook(BookSettings(1.0, True, True, 5, 30.0, learn_period_s=1.0), ledger, clock=lambda: now[0])
    entries = []
    for sid in ("s0", "s1"):
        record = ServerRecord(id=sid, url=f"http://127.0.0.1:1/{sid}", engine=Engine.VLLM, model="m", revision="r",
                              accelerator="A100")
        entries.append(ServerEntry(record=record, status=ServerStatus.HEALTHY, capacity=8, weight=prior_weight(record)))
    book.sync(PoolSnapshot(version=1, taken_at=0.0, entries=tuple(entries)))
    fast, slow = (book.get(e.id) for e in entries)
    assert isinstance(fast, ServerState) and isinstance(slow, ServerState)

    def answer(state: ServerState, latency: float) -> None:
        book.take(state, "c", now[0])
        now[0] += latency
        book.release(state, "c")
        book.note_success(state, 10, latency, "c")

    for _ in range(10):
        answer(fast, 0.1)
        answer(slow, 0.1)
    answer(slow, 0.4)
    answer(slow, 0.4)
    answer(slow, 0.4)  # a slow spell on s1: measured well below s0 on its own latest answer
    measured_slow = book.weight_of(slow)
    assert measured_slow < 0.8 * book.weight_of(fast)
    for _ in range(10):
        answer(fast, 0.1)  # 1 s: within two periods, s1's measurement stands
    assert book.weight_of(slow) == pytest.approx(measured_slow)
    for _ in range(80):
        answer(fast, 0.1)  # 8 s more without an answer from s1: back near the prior's scale (s0's weight)
    assert book.weight_of(slow) > 0.9 * book.weight_of(fast)
    answer(slow, 0.1)
    assert slow.learning is not None and slow.learning.speed_at == now[0]
