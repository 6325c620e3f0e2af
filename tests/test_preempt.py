"""Attempts that give their slot back when this process's capacity lease shrinks (federation/core/attempts.py), on a
real dispatcher over a fake server, in simulated time."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest

from fedpool.deploy.emulator import SGLANG_ABORT_CHECK_S
from fedpool.federation import DispatchConfig
from fedpool.federation.core.attempts import PREEMPT_MAX_AGE_S, engine_cancel_s
from fedpool.federation.core.dispatcher import PREEMPTED, Dispatcher
from fedpool.federation.core.policy import Hold
from fedpool.federation.core.types import Endpoint, InferenceRequest, InferenceResult
from fedpool.federation.core.windows import our_queue
from fedpool.federation.routing.policies import CapacityWeighted, make_policy
from fedpool.registry import LoadSample, PoolSnapshot, ServerEntry
from tests.fakes import FakePool, wall_time
from tests.test_dispatcher import snapshot_of

pytestmark = pytest.mark.looptime


def leased(fakes: FakePool, engine: str = "vllm", prefill_s: float = 0.0) -> Dispatcher:
    """A dispatcher over one fake 4-slot server (0.05 s a token), leased all 4 slots."""
    server = fakes.start(decode_s=0.05, prefill_s=prefill_s)
    snap = snapshot_of([server], capacity=4, engines=[engine])
    dispatcher = fakes.dispatcher(lambda: snap, make_policy("least_inflight"))
    dispatcher.notify_snapshot()
    dispatcher.apply_lease({"s0": 4})
    return dispatcher


def submit(dispatcher: Dispatcher, n: int, words: str = "", **params: float) -> list[asyncio.Future[InferenceResult]]:
    return [asyncio.ensure_future(dispatcher.submit(InferenceRequest.from_body(
        {"prompt": f"{words}q{i}", "max_tokens": 40, "ignore_eos": True, **params}, request_id=f"r{i}",
        model="emu-model", endpoint=Endpoint.COMPLETIONS))) for i in range(n)]


async def slots_come_back_as_the_engine_lets_go(dispatcher: Dispatcher,
                                                calls: list[asyncio.Future[InferenceResult]]) -> None:
    """Three streamed llama.cpp attempts were given back: their slots count until the engine has let them go, and
    the requests run again, each answered once, when the lease grows."""
    delay = engine_cancel_s("llamacpp", streamed=True)
    assert delay is not None
    await asyncio.sleep(delay)
    assert dispatcher.inflight() == {"s0": 1}
    dispatcher.apply_lease({"s0": 4})
    results = await asyncio.gather(*calls)
    assert sum(1 for r in results for a in r.attempts if a.detail == PREEMPTED) == 3
    assert dispatcher.inflight() == {} and dispatcher.stats().completed == 4


@pytest.mark.parametrize("greedy", [False, True], ids=["sampled", "greedy-hedgeable"])
async def test_a_shrunk_lease_takes_back_slots_of_attempts_that_have_only_just_started(fakes: FakePool,
                                                                                       greedy: bool) -> None:
    """Another process's client comes first: the broker shrinks this process's lease to 1 slot. The three youngest
    attempts give their slots back at once (not a whole answer later), go back to the queue, and run again when
    the lease grows: every request answered exactly once, the give-back in its attempt log. Greedy requests may
    be raced by copies at a tail (hedgeable): they are given back the same way, and no copy starts for them."""
    dispatcher = leased(fakes)
    calls = submit(dispatcher, 4, temperature=0.0) if greedy else submit(dispatcher, 4)
    await asyncio.sleep(0.3)
    assert dispatcher.inflight() == {"s0": 4}
    dispatcher.apply_lease({"s0": 1})
    await asyncio.sleep(0.01)
    assert dispatcher.inflight() == {"s0": 1} and dispatcher.stats().waiting == 3
    assert dispatcher.stats().preempted == 3
    assert dispatcher.stats().preempted_lost_s == pytest.approx(0.9, abs=0.05)  # three attempts 0.3 s old
    await asyncio.sleep(0.5)
    assert dispatcher.inflight() == {"s0": 1}  # within the lease until it grows
    dispatcher.apply_lease({"s0": 4})
    results = await asyncio.gather(*calls)
    assert sorted(r.request_id for r in results) == ["r0", "r1", "r2", "r3"]
    given_back = [a for r in results for a in r.attempts if a.detail == PREEMPTED]
    assert len(given_back) == 3 and all(a.failure is None for a in given_back)
    assert sum(1 for r in results if len(r.attempts) == 1) == 1  # the one that kept its slot ran once
    stats = dispatcher.stats()
    assert dispatcher.inflight() == {} and stats.completed == 4 and stats.failed == 0 and stats.hedges == 0


async def test_attempts_older_than_the_age_limit_run_to_their_end(fakes: FakePool) -> None:
    """An attempt that has run PREEMPT_MAX_AGE_S or more has done too much work to throw away: the shrunk lease
    waits for it to end, as before."""
    dispatcher = leased(fakes)
    calls = submit(dispatcher, 4)
    await asyncio.sleep(PREEMPT_MAX_AGE_S + 0.1)
    dispatcher.apply_lease({"s0": 1})
    await asyncio.sleep(0.01)
    assert dispatcher.inflight() == {"s0": 4} and dispatcher.stats().preempted == 0
    results = await asyncio.gather(*calls)
    assert all(len(r.attempts) == 1 for r in results)


async def test_a_caller_cancelling_while_its_slot_is_given_back_cancels_the_request(fakes: FakePool) -> None:
    """The give-back and the caller's own cancel in one turn: the request is cancelled, not run again, and no slot
    is left taken."""
    dispatcher = leased(fakes)
    (call,) = submit(dispatcher, 1)
    await asyncio.sleep(0.2)
    dispatcher.apply_lease({})  # the lease shrank to nothing
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert dispatcher.inflight() == {} and dispatcher.stats().waiting == 0
    dispatcher.apply_lease({"s0": 4})
    await asyncio.sleep(2.0)
    assert dispatcher.stats().submitted == 1 and dispatcher.stats().completed == 0


async def test_on_an_engine_that_runs_a_request_whose_client_went_nothing_is_given_back(fakes: FakePool) -> None:
    """llama.cpp's server (this pool's build) runs a non-streamed request to its end after its client has gone: a
    slot given back there stays busy in the engine and the request sent in its place queues. Requests the
    transport cannot send it as a stream (log probabilities here) are not given back: the shrunk lease waits for
    those attempts to end, as before. vLLM drops the request with its connection, so it may give back."""
    assert engine_cancel_s("vllm") == 0.0 and engine_cancel_s("llamacpp") is None
    dispatcher = leased(fakes, engine="llamacpp")
    calls = submit(dispatcher, 4, logprobs=1)
    await asyncio.sleep(0.3)
    dispatcher.apply_lease({"s0": 1})
    await asyncio.sleep(0.01)
    assert dispatcher.stats().preempted == 0 and dispatcher.inflight() == {"s0": 4}
    results = await asyncio.gather(*calls)
    assert all(len(r.attempts) == 1 for r in results) and dispatcher.inflight() == {}


async def test_on_llamacpp_streamed_attempts_give_their_slot_back(fakes: FakePool) -> None:
    """The transport asks llama.cpp for a stream wherever one carries the whole answer, and llama.cpp stops a
    streamed request at its next token once its client has gone: those attempts give their slots back to a shrunk
    lease as on vLLM (tests/test_streamed_answers.py checks the engine's side on a real llama-server). It notices
    at its next token, so the slots stay counted for `engine_cancel_s` more: nothing is sent in their place while
    the engine may still run the requests given back."""
    delay = engine_cancel_s("llamacpp", streamed=True)
    assert delay is not None and delay > 0 and engine_cancel_s("sglang", streamed=True) is None
    dispatcher = leased(fakes, engine="llamacpp")
    calls = submit(dispatcher, 4)
    await asyncio.sleep(0.3)
    dispatcher.apply_lease({"s0": 1})
    await asyncio.sleep(0.01)
    assert dispatcher.stats().preempted == 3 and dispatcher.stats().waiting == 3
    assert dispatcher.inflight() == {"s0": 4}  # given back, still counted while the engine lets them go
    await slots_come_back_as_the_engine_lets_go(dispatcher, calls)


@pytest.mark.parametrize("renewed", [False, True], ids=["as-it-decodes", "lease-renewed-meanwhile"])
async def test_on_llamacpp_a_streamed_attempt_in_its_prompt_is_given_back_once_it_decodes(fakes: FakePool,
                                                                                          renewed: bool) -> None:
    """llama.cpp reads a cancel between its batches and a prompt is one batch, so a stream cancelled in its prompt
    holds its slot to the prompt's end (preempt.py: 3.6-6.9 s on a real llama-server): giving it back would only
    queue the request sent in its place in the engine. A streamed attempt is taken once its engine has sent its
    first token — at that token, not at the next lease (which may come after the age limit) — and it lets go at
    its next token. The same lease again meanwhile takes nothing twice."""
    dispatcher = leased(fakes, engine="llamacpp", prefill_s=0.05)
    calls = submit(dispatcher, 4, words="a b c ")  # four 4-word prompts: one 0.8 s prefill step
    await asyncio.sleep(0.3)
    dispatcher.apply_lease({"s0": 1})  # in their prompt: none taken now
    await asyncio.sleep(0.01)
    assert dispatcher.stats().preempted == 0 and dispatcher.inflight() == {"s0": 4}
    if renewed:
        await asyncio.sleep(0.2)
        dispatcher.apply_lease({"s0": 1})  # (the lease as the broker renews it, the prompts still running)
    await asyncio.sleep(0.6 - (0.2 if renewed else 0.0))  # the prompt step is done: each has its first token
    assert dispatcher.stats().preempted == 3 and dispatcher.stats().waiting == 3
    await slots_come_back_as_the_engine_lets_go(dispatcher, calls)


async def test_on_llamacpp_an_attempt_whose_prompt_outlasts_the_age_limit_is_not_given_back(fakes: FakePool) -> None:
    """A prompt that ends past the age limit: its attempt has cost too much engine time to be given back, at its
    first token as at a later lease."""
    dispatcher = leased(fakes, engine="llamacpp", prefill_s=0.2)
    calls = submit(dispatcher, 4, words="a b c ")  # four 4-word prompts: one 3.2 s prefill step
    await asyncio.sleep(0.3)
    dispatcher.apply_lease({"s0": 1})
    await asyncio.sleep(3.5)  # past the prompt: each has its first token, older than the limit
    assert dispatcher.stats().preempted == 0 and dispatcher.inflight() == {"s0": 4}
    results = await asyncio.gather(*calls)
    assert all(len(r.attempts) == 1 for r in results) and dispatcher.inflight() == {}


# ---- an engine queue seen by a scrape ------------------------------------------------------------------------
def queued_scrape(snap: PoolSnapshot, running: int, waiting: int, version: int = 2,
                  kv: float | None = None, kv_tokens: int | None = None) -> PoolSnapshot:
    """The same pool, with the first server's engine scraped now: `running` running, `waiting` in its queue, its KV
    cache `kv` full (None: it does not say) of `kv_tokens` (its record's; None: not known)."""
    first, *rest = snap.entries
    record = first.record.model_copy(update={"kv_cache_tokens": kv_tokens}) if kv_tokens else first.record
    scraped = ServerEntry(record=record, status=first.status, capacity=first.capacity, weight=first.weight,
                          load=LoadSample(running=running, waiting=waiting, observed_at=wall_time(),
                                          kv_cache_usage=kv))
    return PoolSnapshot(version=version, taken_at=0.0, entries=(scraped, *rest))


def one_then_two(fakes: FakePool, give_back_queued: bool = True,
                 engine: str = "vllm") -> tuple[Dispatcher, list[PoolSnapshot], PoolSnapshot]:
    """A 2-slot `engine` (0.05 s a token) registered with 16 slots, the only server at first; a vLLM one joins
    with the scrape that shows the first one's queue."""
    slow = fakes.start(max_running=2, decode_s=0.05)
    if engine == "sglang":  # looks for a gone client every 4 s of waiting, as SGLang's tokenizer manager does
        slow.profile = replace(slow.profile, abort_check_s=SGLANG_ABORT_CHECK_S)
    fakes.start(max_running=16, decode_s=0.05)
    both = snapshot_of(fakes.servers, capacity=16, engines=[engine] + ["vllm"] * (len(fakes.servers) - 1))
    current = [PoolSnapshot(version=1, taken_at=0.0, entries=both.entries[:1])]
    dispatcher = fakes.dispatcher(lambda: current[0], make_policy("least_inflight"),
                                  config=DispatchConfig(give_back_queued=give_back_queued))
    dispatcher.notify_snapshot()
    return dispatcher, current, both


@pytest.mark.parametrize("case", ["admitting", "cache-full", "cache-not-said", "cache-room-for-three"])
async def test_a_queue_the_engine_is_still_admitting_shrinks_nothing(fakes: FakePool, case: str) -> None:
    """vLLM and SGLang admit a burst of prompts a step's token budget at a time: the queue a scrape shows while the
    cache is near empty and the batch has free slots is prompts waiting for their prefill step: the window stays
    and nothing is taken back (taken back, an emulated A100 then ran 20-70 of its 256 for ~5 s). The same queue
    behind a full cache, or on an engine that does not say how full its cache is (llama.cpp), is overflow: the
    window shrinks and the attempts beyond it move. Where the record says how large the cache is, only what its
    room takes is admitting (here about three requests of ~21 tokens each — its prompt and half its 40-token budget
    — in 40% of 160): the rest is overflow, taken back though it is under three quarters of those there (a V100 kept
    117 long-context prompts queued behind room for 4 while its twin stood idle). Each request is answered once."""
    dispatcher, current, both = one_then_two(fakes)
    calls = submit(dispatcher, 16)
    await asyncio.sleep(0.2)
    current[0] = PoolSnapshot(version=2, taken_at=0.0, entries=both.entries)  # the second joins, nothing queued
    dispatcher.notify_snapshot()
    await asyncio.sleep(0.01)
    left = 16 - sum(1 for c in calls if c.done())
    assert dispatcher.inflight() == {"s0": 16}
    kv = {"admitting": 0.002, "cache-full": 0.95, "cache-not-said": None, "cache-room-for-three": 0.5}[case]
    tokens = 160 if case == "cache-room-for-three" else None
    current[0] = queued_scrape(both, running=2, waiting=left - 2, version=3, kv=kv, kv_tokens=tokens)
    dispatcher.notify_snapshot()
    await asyncio.sleep(0.01)
    window = next(s for s in dispatcher.stats().servers if s.server_id == "s0").window
    if case == "admitting":
        assert window == 16 and dispatcher.stats().preempted == 0 and dispatcher.inflight() == {"s0": left}
    elif case == "cache-room-for-three":  # what runs (2), what the cache's room takes (~3) and the allowance (2)
        assert left - 2 - 3 < 0.75 * left and window == 7 and dispatcher.stats().preempted == left - window
        assert dispatcher.inflight() == {"s0": window, "s1": left - window}
    else:  # what runs (2) and the allowance (2); the rest run on the server with room
        assert window == 4 and dispatcher.stats().preempted == left - 4
        assert dispatcher.inflight() == {"s0": 4, "s1": left - 4}
    results = await asyncio.gather(*calls)
    assert len({r.request_id for r in results}) == 16 and all(len(r.attempts) >= 1 for r in results)
    assert dispatcher.inflight() == {}


@pytest.mark.parametrize("age", [0.2, PREEMPT_MAX_AGE_S + 0.5], ids=["just-sent", "older-than-the-lease-limit"])
async def test_a_scrape_of_a_deep_engine_queue_takes_the_queued_attempts_back(fakes: FakePool, age: float) -> None:
    """Sixteen attempts on an engine that runs two: its window was the registered 16, and no answer comes for
    2 s to shrink it. The next scrape shows 14 of them queued: the window shrinks at once, the attempts beyond it
    (the youngest, which the engine has not started) give their slots back and run on the server that has room,
    each request answered exactly once. A queued attempt has used no engine time however long it waited: those
    sent over a second before the scrape are taken too (a lease's give-back is not)."""
    dispatcher, current, both = one_then_two(fakes)
    slow = fakes.servers[0]
    calls = submit(dispatcher, 16)
    await asyncio.sleep(age)
    assert dispatcher.inflight() == {"s0": 16} and slow.running == 2
    current[0] = queued_scrape(both, running=2, waiting=14)
    dispatcher.notify_snapshot()
    await asyncio.sleep(0.01)
    window = next(s for s in dispatcher.stats().servers if s.server_id == "s0")
    assert window.window == 4 and window.window_reason is not None and "scrape" in window.window_reason  # 2 + 2
    assert dispatcher.stats().preempted == 12 and dispatcher.inflight() == {"s0": 4, "s1": 12}
    results = await asyncio.gather(*calls)
    assert sorted(r.request_id for r in results) == sorted(f"r{i}" for i in range(16))
    given_back = [r for r in results if any(a.detail == PREEMPTED for a in r.attempts)]
    assert len(given_back) == 12 and all(r.server_id == "s1" for r in given_back)
    assert slow.cancelled >= 12 and dispatcher.inflight() == {}  # the engine dropped them; every slot came back


async def test_on_sglang_queued_attempts_are_given_back_and_aborted_by_their_ids(fakes: FakePool) -> None:
    """SGLang notices a closed connection only at its next 4 s check, but aborts a request by its id at once: the
    queued attempts a scrape shows are taken back as on vLLM, leave the engine at once (none of them runs there),
    and run on the other server, each answered once."""
    assert engine_cancel_s("sglang") == 0.0
    dispatcher, current, both = one_then_two(fakes, engine="sglang")
    slow = fakes.servers[0]
    calls = submit(dispatcher, 16)
    await asyncio.sleep(0.2)
    current[0] = queued_scrape(both, running=2, waiting=14)
    dispatcher.notify_snapshot()
    await asyncio.sleep(0.01)
    assert dispatcher.stats().preempted == 12 and dispatcher.inflight() == {"s0": 4, "s1": 12}
    assert slow.engine.running == 2 and slow.engine.waiting == 2  # the 12 left the engine's queue at once
    results = await asyncio.gather(*calls)
    assert sorted(r.request_id for r in results) == sorted(f"r{i}" for i in range(16))
    given_back = [r for r in results if any(a.detail == PREEMPTED for a in r.attempts)]
    assert len(given_back) == 12 and all(r.server_id == "s1" for r in given_back)
    assert slow.completed == 4 and slow.engine.counters.finished == 4 and dispatcher.inflight() == {}


async def test_a_scrapes_queue_is_read_against_what_was_in_flight_when_it_was_taken(fakes: FakePool) -> None:
    """The answers' engine-queue rule compares the newest scrape's queue with this dispatcher's attempts there when
    that scrape was taken, not with those in flight at the answer: a scrape of 12 queued of 16, read at the next
    answer (15 left), cut the window to 15 − 12 + 2 = 5 where the engine had been running 4 of ours plus a short
    queue (an SGLang A100 in a perturbed Table 7 world went from 137 to 1 this way and took 7 s to grow back)."""
    server = fakes.start(max_running=4, decode_s=0.05)
    snap = snapshot_of([server], capacity=16)
    current = [snap]
    dispatcher = fakes.dispatcher(lambda: current[0], make_policy("least_inflight"),
                                  config=DispatchConfig(give_back_queued=False))
    dispatcher.notify_snapshot()
    calls = submit(dispatcher, 16)
    await asyncio.sleep(0.2)
    current[0] = queued_scrape(snap, running=4, waiting=12)
    dispatcher.notify_snapshot()
    await asyncio.sleep(0.01)

    def window() -> tuple[int, str | None]:
        stats = next(s for s in dispatcher.stats().servers if s.server_id == "s0")
        return stats.window, stats.window_reason

    assert window()[0] == 6  # the scrape's own rule: 4 running + 2
    await asyncio.sleep(2.3)  # the first 4 answer at 2.3 s (40 steps of 57.5 ms), the next 4 start
    assert server.completed == 4
    size, reason = window()
    assert reason is not None and reason.startswith("engine queue 12") and "scrape" not in reason
    assert size == 6 and dispatcher.inflight() == {"s0": 12}
    await asyncio.gather(*calls)
    assert dispatcher.inflight() == {}


async def test_a_short_engine_queue_or_the_option_off_takes_nothing_back(fakes: FakePool) -> None:
    """A queue of fewer than three quarters of this dispatcher's attempts there keeps a KV-bound engine's batch
    full: no shrink between answers. With `give_back_queued` off, a deep queue shrinks the window (no more are
    sent) but what was sent stays."""
    dispatcher, current, both = one_then_two(fakes)
    calls = submit(dispatcher, 16)
    await asyncio.sleep(0.2)
    current[0] = queued_scrape(both, running=6, waiting=10)
    dispatcher.notify_snapshot()
    await asyncio.sleep(0.01)
    assert dispatcher.stats().preempted == 0 and dispatcher.inflight() == {"s0": 16}
    await asyncio.gather(*calls)

    dispatcher, current, both = one_then_two(fakes, give_back_queued=False)
    calls = submit(dispatcher, 16)
    await asyncio.sleep(0.2)
    current[0] = queued_scrape(both, running=2, waiting=14)
    dispatcher.notify_snapshot()
    await asyncio.sleep(0.01)
    window = next(s for s in dispatcher.stats().servers if s.server_id == "s0")
    assert window.window == 4 and dispatcher.stats().preempted == 0 and dispatcher.inflight() == {"s0": 16}
    results = await asyncio.gather(*calls)
    assert all(len(r.attempts) == 1 for r in results) and dispatcher.inflight() == {}


@pytest.mark.parametrize("case", ["tail", "the-only-server", "still-sending"])
async def test_at_a_tail_a_short_engine_queue_is_taken_back_for_a_server_with_room(fakes: FakePool, case: str) -> None:
    """The client has sent its last request and nothing waits in the dispatcher: a queue too short to shrink a
    window mid-run (10 of 16 waiting, under three quarters) only lengthens the run where another server has room.
    The scrape shrinks the window to what runs and one more (6 + 1); the 9 attempts beyond it run on the other
    server, each answered once (a Table 7 V100 kept 35-60 long prompts queued for 40 s while the three other
    servers idled). The same queue stays on the pool's only server (nowhere sooner to run it), and while the client
    says it has more to send (its next requests would find the engine's batch empty)."""
    dispatcher, current, both = one_then_two(fakes)
    calls = submit(dispatcher, 16)
    if case == "still-sending":
        dispatcher.set_client_requests_left("default", 100)
    else:
        dispatcher.client_done_sending("default")
    await asyncio.sleep(0.2)
    assert dispatcher.inflight() == {"s0": 16}
    if case != "the-only-server":
        current[0] = both  # the second server joins, idle: nothing waits to go to it
        dispatcher.notify_snapshot()
    current[0] = queued_scrape(current[0], running=6, waiting=10, version=3)
    dispatcher.notify_snapshot()
    await asyncio.sleep(0.01)
    window = next(s for s in dispatcher.stats().servers if s.server_id == "s0")
    if case != "tail":
        assert dispatcher.stats().preempted == 0 and dispatcher.inflight() == {"s0": 16} and window.window == 16
        await asyncio.gather(*calls)
        return
    assert window.window == 7 and window.window_reason is not None and "tail" in window.window_reason
    assert dispatcher.stats().preempted == 9 and dispatcher.inflight() == {"s0": 7, "s1": 9}
    results = await asyncio.gather(*calls)
    assert sorted(r.request_id for r in results) == sorted(f"r{i}" for i in range(16))
    given_back = [r for r in results if any(a.detail == PREEMPTED for a in r.attempts)]
    assert len(given_back) == 9 and all(r.server_id == "s1" for r in given_back)
    assert dispatcher.inflight() == {}


async def test_another_process_s_queue_on_the_engine_is_not_counted_as_ours(fakes: FakePool) -> None:
    """Six of ours running beside another process's two, and its six waiting in the engine's queue: of the queue,
    ours is in proportion to what we had there (6 of 14: 2.6, under three quarters of our 6), so our window keeps
    its size and nothing is taken back. Counted whole (up to our 6) it was a deep queue of ours: the window of a
    process of long answers shrank to 2 beside a process of long prompts, its leased slots idle. The engine's only
    client still reads the whole queue as its own (the tests above)."""
    assert our_queue(6, 8, 6) == pytest.approx(6 * 6 / 14)
    assert our_queue(14, 2, 16) == 14 and our_queue(0, 0, 0) == 0
    server = fakes.start(max_running=16, decode_s=0.05)
    snap = snapshot_of([server], capacity=16)
    current = [snap]
    dispatcher = fakes.dispatcher(lambda: current[0], make_policy("least_inflight"))
    dispatcher.notify_snapshot()
    calls = submit(dispatcher, 6)
    await asyncio.sleep(0.2)
    current[0] = queued_scrape(snap, running=8, waiting=6)
    dispatcher.notify_snapshot()
    await asyncio.sleep(0.01)
    stats = next(s for s in dispatcher.stats().servers if s.server_id == "s0")
    assert stats.window >= 6 and (stats.window_reason is None or "scrape" not in stats.window_reason)
    assert dispatcher.stats().preempted == 0 and dispatcher.inflight() == {"s0": 6}
    results = await asyncio.gather(*calls)
    assert all(len(r.attempts) == 1 for r in results) and dispatcher.inflight() == {}


class _Holding(CapacityWeighted):
    """A real policy that holds one client while `hold` (as a plan does a client it wants on servers without room)."""

    hold = True

    def place(self, route: Any, request: InferenceRequest, tried: set[str]) -> Any:
        if self.hold and request.client_id == "short":
            return Hold.CLIENT_HELD
        return super().place(route, request, tried)


@pytest.mark.parametrize("held", [True, False], ids=["held", "placed"])
async def test_no_slot_is_taken_for_a_client_the_policy_holds(fakes: FakePool, held: bool) -> None:
    """shortest_first, a full route: a short caller waits behind a long one's young attempts. Placed, it takes
    some of them (`_take_for_order`). Held by the policy, taking them only handed the slots back to the long one
    at the next grant: three small batches took each other's attempts at every pass and none of 155 requests
    ended in 12 minutes. Now one round is taken for it, and no more until it has been granted a slot."""
    server = fakes.start(decode_s=0.05)
    snap = snapshot_of([server], capacity=4, engines=["vllm"])
    policy = _Holding()
    policy.hold = held
    dispatcher = fakes.dispatcher(lambda: snap, policy, config=DispatchConfig(client_order="shortest_first"))
    dispatcher.notify_snapshot()
    dispatcher.apply_lease({"s0": 4})

    def send(client: str, n: int) -> list[asyncio.Future[InferenceResult]]:
        dispatcher.set_client_requests_left(client, n)
        return [asyncio.ensure_future(dispatcher.submit(InferenceRequest.from_body(
            {"prompt": f"{client} q{i}", "max_tokens": 40, "ignore_eos": True}, request_id=f"{client}-{i}",
            model="emu-model", endpoint=Endpoint.COMPLETIONS, client_id=client))) for i in range(n)]

    long = send("long", 8)
    await asyncio.sleep(0.1)  # the long caller's first four hold every slot, 0.1 s old
    short = send("short", 2)
    await asyncio.sleep(0.3)
    first = dispatcher.stats().preempted
    assert 1 <= first <= (2 if held else 4)  # held: one round for the short caller (two of its requests wait)
    await asyncio.sleep(1.0)
    if held:  # never again while it has not been granted a slot (before, at every pass: none ended)
        assert dispatcher.stats().preempted == first and dispatcher.stats().completed == 0
    policy.hold = False
    await asyncio.gather(*long, *short)
    assert dispatcher.stats().completed == 10
