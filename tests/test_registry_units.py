"""Registry pieces without Ray: records, adapters on real/documented metrics, status, state, persistence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from fedpool.registry import Engine, LoadSample, ProbeResult, RegistrationError, ServerRecord, ServerStatus, adapter_for
from fedpool.registry.adapters import MetricsParseError
from fedpool.registry.adapters.base import MetricSamples
from fedpool.registry.adapters.vllm import VllmAdapter
from fedpool.registry.auth import check_token, ensure_token, token_digest
from fedpool.registry.errors import AuthError, UnknownServerError
from fedpool.registry.persistence import StateStore
from fedpool.registry.state import RegistryState, RegistryTimings
from fedpool.registry.status import StatusThresholds, derive_status

METRICS = Path(__file__).parent / "data" / "metrics"


def rec(**kw: object) -> ServerRecord:
    base: dict[str, object] = {"id": "s1", "url": "http://127.0.0.1:8000", "engine": "vllm", "model": "m"}
    return ServerRecord.model_validate({**base, **kw})


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


# ---- records ----------------------------------------------------------------------------------
def test_record_normalises_url_and_accelerator() -> None:
    r = rec(url="http://10.0.0.5:8000/", accelerator="a100-80gb")
    assert r.url == "http://10.0.0.5:8000"
    assert r.accelerator == "A100"
    assert rec(accelerator="h100").accelerator == "H100"
    assert rec(accelerator="Gaudi3").accelerator == "GAUDI3"


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("url", "ftp://host:1", "url"),
        ("url", "not a url", "url"),
        ("url", "http://user:pw@host:1", "credentials"),
        ("id", "has space", "id"),
        ("id", "", "id"),
        ("engine", "tensorrt", "engine"),
        ("model", "", "model"),
        ("gpu_count", -1, "gpu_count"),
        ("capacity", 0, "capacity"),
        ("labels", {"bad key!": "x"}, "label"),
    ],
)
def test_record_rejects_bad_fields_naming_them(field: str, value: object, fragment: str) -> None:
    with pytest.raises(ValidationError) as err:
        rec(**{field: value})
    assert fragment in str(err.value)


# ---- adapters ---------------------------------------------------------------------------------
def test_vllm_sums_engine_series_and_averages_kv() -> None:
    load = adapter_for(Engine.VLLM).parse_metrics((METRICS / "vllm_dp2.txt").read_text(), 5.0)
    assert (load.running, load.waiting) == (21.0, 4.0)
    assert load.kv_cache_usage == pytest.approx(0.4)
    assert load.generation_tokens_total == 200000.0
    assert load.observed_at == 5.0
    samples = MetricSamples((METRICS / "vllm_dp2.txt").read_text())
    assert VllmAdapter.kv_cache_tokens(samples) == 2 * 2048 * 16


def test_vllm_real_cpu_capture() -> None:
    """Captured from vLLM 0.32.0's CPU build (--max-num-seqs 4, 32 requests in flight; see README there)."""
    text = (METRICS / "vllm_cpu.txt").read_text()
    load = adapter_for(Engine.VLLM).parse_metrics(text, 2.0)
    assert (load.running, load.waiting) == (4.0, 24.0)
    assert load.kv_cache_usage == pytest.approx(0.0009766817238432424)
    assert load.generation_tokens_total == 6301.0
    assert VllmAdapter.kv_cache_tokens(MetricSamples(text)) == 8192 * 128


def test_vllm_reads_pre_v1_cache_name() -> None:
    load = adapter_for("vllm").parse_metrics((METRICS / "vllm_v0.txt").read_text(), 1.0)
    assert (load.running, load.waiting, load.kv_cache_usage) == (4.0, 0.0, 0.125)


def test_sglang_sums_ranks() -> None:
    load = adapter_for("sglang").parse_metrics((METRICS / "sglang_dp2.txt").read_text(), 1.0)
    assert (load.running, load.waiting) == (312.0, 2.0)
    assert load.tokens_per_s == 700.0
    assert load.kv_cache_usage == pytest.approx(0.2)


def test_llamacpp_real_capture() -> None:
    text = (METRICS / "llamacpp.txt").read_text()
    load = adapter_for("llamacpp").parse_metrics(text, 1.0)
    assert load.running >= 1  # captured with requests in flight
    assert load.generation_tokens_total is not None and load.generation_tokens_total > 0


def test_garbage_metrics_raise_typed_error() -> None:
    with pytest.raises(MetricsParseError):
        adapter_for("vllm").parse_metrics('vllm:num_requests_running{engine="0" 1\n', 1.0)


def test_metrics_without_known_names_read_as_idle() -> None:
    load = adapter_for("vllm").parse_metrics("# nothing here\n", 1.0)
    assert (load.running, load.waiting, load.kv_cache_usage) == (0.0, 0.0, None)


# ---- status -----------------------------------------------------------------------------------
def probes(*oks: bool) -> list[ProbeResult]:
    return [ProbeResult("s1", ok, 0.01, float(i)) for i, ok in enumerate(oks)]


TH = StatusThresholds(down_after_failures=3, up_after_successes=2)


@pytest.mark.parametrize(
    ("history", "expected"),
    [
        ((), ServerStatus.HEALTHY),
        ((True, True), ServerStatus.HEALTHY),
        ((True, False), ServerStatus.SUSPECT),
        ((False, False), ServerStatus.SUSPECT),
        ((False, False, False), ServerStatus.DOWN),
        ((False, False, False, True), ServerStatus.DOWN),  # one success is not enough to come back
        ((False, False, False, True, True), ServerStatus.HEALTHY),
        ((False, True), ServerStatus.HEALTHY),
    ],
)
def test_status_hysteresis(history: tuple[bool, ...], expected: ServerStatus) -> None:
    assert derive_status(probes(*history), thresholds=TH, now=100.0) is expected


def test_status_lease_drain_and_passive_failures() -> None:
    assert derive_status(probes(True), thresholds=TH, now=10, lease_expired=True) is ServerStatus.DOWN
    assert derive_status(probes(True), thresholds=TH, now=10, draining=True) is ServerStatus.DRAINING
    assert derive_status(probes(False, False, False), thresholds=TH, now=10, draining=True) is ServerStatus.DOWN
    recent = [9.0, 9.5, 9.9]
    assert derive_status(probes(True), thresholds=TH, now=10, passive_failure_times=recent) is ServerStatus.SUSPECT
    old = [-100.0, -99.0, -98.0]
    assert derive_status(probes(True), thresholds=TH, now=10, passive_failure_times=old) is ServerStatus.HEALTHY


# ---- state ------------------------------------------------------------------------------------
def test_duplicates_update_or_refuse_deliberately() -> None:
    state = RegistryState(clock=Clock())
    state.upsert(rec(), 8)
    assert state.check_duplicate(rec(), replace=False) is True  # same id + url: an update
    with pytest.raises(RegistrationError) as err:
        state.check_duplicate(rec(url="http://127.0.0.1:9000"), replace=False)
    assert err.value.field == "id"
    assert state.check_duplicate(rec(url="http://127.0.0.1:9000"), replace=True) is True
    with pytest.raises(RegistrationError) as err:
        state.check_duplicate(rec(id="s2"), replace=True)
    assert err.value.field == "url" and "s1" in str(err.value)


def test_versions_grow_and_snapshots_are_frozen() -> None:
    state = RegistryState(clock=Clock())
    v0 = state.version
    state.upsert(rec(), 8)
    snap = state.snapshot()
    assert snap.version > v0 and snap.ids() == ("s1",)
    with pytest.raises(AttributeError):
        snap.version = 99
    state.upsert(rec(id="s2", url="http://127.0.0.1:8001", model="other"), 4)
    assert state.snapshot().version > snap.version
    assert state.snapshot().filter(model="other").ids() == ("s2",)
    assert snap.ids() == ("s1",)  # the old snapshot did not change


def test_probe_facts_drive_status_and_rate() -> None:
    clock = Clock()
    state = RegistryState(clock=clock, thresholds=TH)
    state.upsert(rec(), 8)
    for _ in range(3):
        clock.t += 1
        state.record_probe(ProbeResult("s1", False, 1.0, clock.t, "refused"))
    assert state.get("s1").status is ServerStatus.DOWN
    assert state.get("s1").last_error == "refused"
    for tokens in (100.0, 300.0):
        clock.t += 2
        load = LoadSample(running=2, waiting=0, observed_at=clock.t, generation_tokens_total=tokens)
        state.record_probe(ProbeResult("s1", True, 0.01, clock.t, load=load))
    entry = state.get("s1")
    assert entry.status is ServerStatus.HEALTHY
    assert entry.load is not None and entry.load.tokens_per_s == pytest.approx(100.0)


def test_lease_expiry_marks_down_then_removes() -> None:
    clock = Clock()
    state = RegistryState(clock=clock, timings=RegistryTimings(lease_grace_s=10))
    state.upsert(rec(), 8, lease_ttl_s=5)
    clock.t += 4
    state.heartbeat("s1")
    clock.t += 6
    state.expire()
    assert state.get("s1").status is ServerStatus.DOWN
    clock.t += 11
    assert state.expire() == ["s1"]
    with pytest.raises(UnknownServerError):
        state.get("s1")


def test_drain_removes_once_idle_by_engine_metrics() -> None:
    clock = Clock()
    state = RegistryState(clock=clock)
    state.upsert(rec(), 8)
    state.drain("s1")
    assert state.get("s1").status is ServerStatus.DRAINING
    assert state.snapshot().filter(routable_only=True).ids() == ()
    clock.t += 1
    state.record_probe(ProbeResult("s1", True, 0.01, clock.t, load=LoadSample(3, 0, clock.t)))
    assert state.expire() == []
    clock.t += 1
    state.record_probe(ProbeResult("s1", True, 0.01, clock.t, load=LoadSample(0, 0, clock.t)))
    assert state.expire() == ["s1"]
    assert state.remove("s1").id == "s1"  # `server remove` after the drain finished it: no error


def test_a_launched_server_stays_draining_and_a_removed_one_is_told_so() -> None:
    """A server with a lease (its launcher heartbeats: `fedpool serve`, `fedpool up`) that an operator drained stays,
    draining and unroutable, however long it idles (past the drain timeout: removed, its launcher used to register
    it again, healthy); removed by an operator, its heartbeats are answered "removed" until it is registered again.
    A server that merely lost its lease is not: its launcher registers it again."""
    clock = Clock()
    state = RegistryState(clock=clock, timings=RegistryTimings(lease_grace_s=10, drain_timeout_s=30))
    state.upsert(rec(), 8, lease_ttl_s=30)
    state.drain("s1")
    for _ in range(12):  # 60 s of heartbeats every 5 s, the engine idle
        clock.t += 5
        state.record_probe(ProbeResult("s1", True, 0.01, clock.t, load=LoadSample(0, 0, clock.t)))
        assert state.heartbeat("s1").status is ServerStatus.DRAINING
        assert state.expire() == []
    assert state.snapshot().filter(routable_only=True).ids() == ()
    state.remove("s1")
    with pytest.raises(UnknownServerError) as removed:
        state.heartbeat("s1")
    assert removed.value.removed and "it was removed: by `fedpool server remove`" in str(removed.value)
    assert state.remove("s1").id == "s1"  # removing it again is no error
    state.upsert(rec(), 8, lease_ttl_s=30)  # registered again (`fedpool server add`, a new `fedpool serve`)
    assert state.heartbeat("s1").status is ServerStatus.HEALTHY
    clock.t += 100  # its lease lapses: removed after the grace period, not by an operator
    assert state.expire() == ["s1"]
    with pytest.raises(UnknownServerError) as lapsed:
        state.heartbeat("s1")
    assert not lapsed.value.removed


def test_persistence_round_trip(tmp_path: Path) -> None:
    clock = Clock()
    state = RegistryState(clock=clock)
    state.upsert(rec(labels={"rack": "r1"}), 8, lease_ttl_s=30)
    state.upsert(rec(id="s2", url="http://127.0.0.1:8001"), 4)
    state.drain("s2")
    store = StateStore(tmp_path)
    store.save(state.to_json())
    restored = RegistryState(clock=clock)
    restored.load_json(store.load() or {})
    assert restored.version > state.version
    assert [r.model_dump() for r in restored.records()] == [r.model_dump() for r in state.records()]
    assert restored.get("s2").status is ServerStatus.DRAINING
    assert restored.get("s1").record.labels == {"rack": "r1"}
    state.remove("s1")
    store.save(state.to_json())
    restored.load_json(store.load() or {})
    with pytest.raises(UnknownServerError) as removed:  # a restarted registry still tells a removed server's launcher
        restored.heartbeat("s1")
    assert removed.value.removed
    (tmp_path / "registry.json").write_text("{broken")
    with pytest.raises(ValueError, match=r"registry\.json"):
        store.load()


# ---- auth -------------------------------------------------------------------------------------
def test_token_file_is_private_and_checked(tmp_path: Path) -> None:
    token = ensure_token(tmp_path)
    assert (tmp_path / "registry.token").stat().st_mode & 0o777 == 0o600
    assert ensure_token(tmp_path) == token  # stable across restarts
    check_token(token, token_digest(token))
    with pytest.raises(AuthError):
        check_token("wrong", token_digest(token))
    with pytest.raises(AuthError, match="needs the registry token: pass --token-file-path") as missing:
        check_token(None, token_digest(token))
    assert "FEDPOOL_REGISTRY_TOKEN" in str(missing.value)  # how to pass it, not only that it is needed
    assert token not in json.dumps(RegistryState(clock=Clock()).to_json())


def test_slow_probes_of_a_busy_engine_are_not_failures_for_a_while() -> None:
    slow = [ProbeResult("s1", False, 5.0, float(i), "timeout (engine busy)", busy=True) for i in range(5)]
    assert derive_status(slow, thresholds=TH, now=10) is ServerStatus.HEALTHY
    hung = [ProbeResult("s1", False, 5.0, float(i), "timeout (engine busy)", busy=True) for i in range(8)]
    assert derive_status(hung, thresholds=TH, now=10) is ServerStatus.DOWN  # a hung engine still goes down
    idle_timeouts = [ProbeResult("s1", False, 5.0, float(i), "timeout") for i in range(3)]
    assert derive_status(idle_timeouts, thresholds=TH, now=10) is ServerStatus.DOWN


def test_wire_rows_rebuild_the_same_snapshot_lazily() -> None:
    from fedpool.registry import PoolSnapshot, prior_weight

    clock = Clock()
    state = RegistryState(clock=clock)
    state.upsert(rec(), 8)
    state.upsert(rec(id="s2", url="http://127.0.0.1:8001", accelerator="V100"), 4)
    load = LoadSample(running=3, waiting=1, observed_at=clock.t, kv_cache_usage=0.5, generation_tokens_total=10.0)
    state.record_probe(ProbeResult("s1", True, 0.02, clock.t, load=load))
    state.record_probe(ProbeResult("s2", False, 1.0, clock.t, "refused"))
    full = state.snapshot()
    records = {r.id: r for r in state.records()}
    lazy = PoolSnapshot.from_rows(full.version, full.taken_at, state.wire_rows(), records, prior_weight)
    assert lazy.entries == full.entries and lazy == full
    assert lazy.get("s2").last_error == "refused"  # type: ignore[union-attr]
    with pytest.raises(AttributeError):
        lazy.version = 7
    membership = state.membership_version
    state.record_probe(ProbeResult("s1", True, 0.02, clock.t, load=load))
    assert state.membership_version == membership  # load changes do not resend records


def test_only_wanted_families_reach_the_parser() -> None:
    from fedpool.registry.adapters.base import select_families

    text = (METRICS / "vllm_dp2.txt").read_text()
    kept = select_families(text, frozenset({"vllm:num_requests_running"}))
    assert "e2e_request_latency" not in kept and "num_requests_waiting" not in kept
    assert kept.count("vllm:num_requests_running{") == 2 and "# TYPE vllm:num_requests_running gauge" in kept
    full = MetricSamples(text)
    assert full.total("vllm:num_requests_running") == MetricSamples(text, VllmAdapter.wanted_metrics).total(
        "vllm:num_requests_running"
    )
    assert MetricSamples(text, VllmAdapter.wanted_metrics).total("vllm:generation_tokens_total") == 200000.0


def test_probe_rows_round_trip() -> None:
    from fedpool.registry.snapshot import probe_from_row, probe_to_row

    full = ProbeResult("s1", True, 0.01, 5.0, None, LoadSample(2, 1, 4.0, 0.5, 100.0, None, 8))
    bare = ProbeResult("s2", False, 1.0, 5.0, "refused", None, busy=True)
    assert probe_from_row(probe_to_row(full)) == full and probe_from_row(probe_to_row(bare)) == bare


def test_a_probe_batch_is_one_version_but_operator_actions_are_not_held_back() -> None:
    clock = Clock()
    state = RegistryState(clock=clock)
    state.upsert(rec(), 8)
    before = state.version
    with state.batch():
        for _ in range(5):
            state.record_probe(ProbeResult("s1", True, 0.01, clock.t, load=LoadSample(1, 0, clock.t)))
        assert state.version == before  # readers still see the previous picture
        state.upsert(rec(id="s2", url="http://127.0.0.1:8001"), 4)
        assert state.version == before + 1  # a registration shows at once
    assert state.version == before + 2
