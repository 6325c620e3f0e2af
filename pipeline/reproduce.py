"""Reproduction from an artifact: the exact benchmark configuration a run used (for replay), and
rescoring its records (post-processing, metrics, the verifier) without any inference.

An artifact directory is a run directory (`fedpool eval run --out DIR`: one sub-directory per benchmark)
or one benchmark's directory (`config.json`, `records.jsonl`, `summary.json`). The original is never
changed: rescoring writes a new artifact.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedpool.pipeline.artifact import CONFIG_FILE, RECORDS_FILE, ArtifactWriter, read_records
from fedpool.pipeline.errors import ArtifactError, SpecError
from fedpool.pipeline.loaders import dataset_sha256
from fedpool.pipeline.schema import Record
from fedpool.pipeline.scoring import rescore_record, summarize_records
from fedpool.pipeline.spec import BenchmarkSpec, spec_from_dict
from fedpool.pipeline.verifier import JudgeItem, Judgment, VerifierPool, judge_item, with_judgment

# What a rescore may change: everything else decides the model's answers, so changing it needs inference.
RESCORABLE_FIELDS = frozenset({"postprocess", "metrics", "verifier", "description", "version"})


@dataclass(frozen=True, slots=True)
class SavedBenchmark:
    """One benchmark of an artifact: where it is, its saved configuration, and the spec rebuilt from it."""

    dir: Path
    config: dict[str, Any]
    spec: BenchmarkSpec


def benchmark_dirs(artifact: Path) -> list[Path]:
    """The benchmark directories of a run directory, or the directory itself when it is one."""
    artifact = artifact.expanduser().resolve()
    if (artifact / CONFIG_FILE).is_file():
        return [artifact]
    found = sorted(p.parent for p in artifact.glob(f"*/{CONFIG_FILE}"))
    if not found:
        raise ArtifactError(f"{artifact}: no benchmark artifact here (no */{CONFIG_FILE}); give a run directory "
                            "made by `fedpool eval run` or one of its benchmark directories")
    return found


def load_saved(bench_dir: Path, *, check_data: bool = True) -> SavedBenchmark:
    """The saved configuration and the spec it describes. With `check_data`, the dataset must still be the
    one the run read (same SHA-256), or the replay would not be the same evaluation."""
    path = bench_dir / CONFIG_FILE
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
        raw = dict(config["benchmark"])
        dataset = config["dataset"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ArtifactError(f"{path}: not a fedpool benchmark configuration ({type(exc).__name__}: {exc})") from None
    raw["data"] = {**raw["data"], "path": dataset["path"]}  # absolute, as the run resolved it
    try:
        spec = spec_from_dict(raw, source=str(path))
    except SpecError as exc:
        raise ArtifactError(str(exc)) from None
    if check_data:
        data_path = Path(dataset["path"])
        if not data_path.exists():
            raise ArtifactError(f"{path}: the run's dataset {data_path} is gone; it is needed to replay the run")
        now = dataset_sha256(data_path)
        if now != dataset.get("sha256"):
            raise ArtifactError(f"{path}: the dataset {data_path} changed since the run "
                                f"(sha256 {now[:16]}… ≠ {str(dataset.get('sha256'))[:16]}…); a replay would not "
                                "be the same evaluation")
    return SavedBenchmark(bench_dir, config, spec)


def rescoring_spec(saved: BenchmarkSpec, new: BenchmarkSpec | None) -> BenchmarkSpec:
    """The spec to rescore with: the saved one, or `new` when it differs only in what rescoring can redo."""
    if new is None:
        return saved
    if new.name != saved.name:
        raise SpecError(f"{new.source_file}: benchmark {new.name!r} is not the artifact's {saved.name!r}")
    old_dump = saved.model_dump(mode="json", exclude=set(RESCORABLE_FIELDS) | {"data", "source_file"})
    new_dump = new.model_dump(mode="json", exclude=set(RESCORABLE_FIELDS) | {"data", "source_file"})
    changed = sorted(k for k in old_dump if old_dump[k] != new_dump.get(k))
    if changed:
        raise SpecError(f"{new.source_file}: {', '.join(changed)} changed; these decide the model's answers, so "
                        "they need a new run (`fedpool eval run`), not a rescore")
    return new.model_copy(update={"data": saved.data})


Judge = Callable[[JudgeItem], Awaitable[Judgment]]


async def rescore_benchmark(
    saved: SavedBenchmark,
    out_dir: Path,
    *,
    spec: BenchmarkSpec | None = None,
    judge: Judge | None = None,
    secrets: Iterable[str] = (),
) -> dict[str, Any]:
    """Recompute post-processing and metrics for every record (and the verifier's judgment, with `judge`)
    into a new artifact under `out_dir/NAME`; returns its summary. Failed records stay failed (worst value)."""
    use = rescoring_spec(saved.spec, spec)
    if use.verifier and judge is None:
        raise ArtifactError(f"{use.name}: the spec asks for the verifier; rescoring needs a verifier pool")
    records = read_records(saved.dir / RECORDS_FILE)
    fingerprint = f"{use.fingerprint()}-rescore-of-{saved.config.get('fingerprint')}"
    config = {**saved.config, "benchmark": use.model_dump(mode="json"), "fingerprint": fingerprint,
              "rescored_from": str(saved.dir)}
    writer = ArtifactWriter(out_dir / use.name, config, secrets=secrets)
    try:
        for record in records:
            if record.sample_id in writer.done_ids:
                continue
            writer.write(await _rescored(use, record, judge))
    finally:
        writer.close()
    final = read_records(writer.path)
    summary = summarize_records(use, final)
    summary.update({"model": saved.config.get("model"), "revision": saved.config.get("revision"),
                    "dataset_sha256": saved.config.get("dataset", {}).get("sha256"),
                    "rescored_from": str(saved.dir), "expected_records": len(records)})
    writer.write_summary(summary)
    return summary


async def _rescored(spec: BenchmarkSpec, record: Record, judge: Judge | None) -> Record:
    raw = record.output.text.prediction[0] if record.output.text.prediction else None
    if record.failed:
        raw = None
    fresh = rescore_record(spec, record.model_copy(update={"verifier": None}), raw,
                           reasoning=record.output.reasoning_content)
    if not spec.verifier or judge is None:
        return fresh
    if fresh.failed:
        return with_judgment(fresh, None)
    try:
        return with_judgment(fresh, await judge(judge_item(fresh)))
    except Exception:  # a broken judge must not lose the record: it is written unjudged (counted)
        return with_judgment(fresh, None)


def rescore_plan(artifact: Path, new_specs: Sequence[BenchmarkSpec],
                 out: Path) -> list[tuple[SavedBenchmark, BenchmarkSpec]]:
    """Each benchmark of `artifact` with the spec to rescore it with: its own, or the one of `new_specs` of its
    name. ArtifactError for a spec of no benchmark of it, or an `out` that already holds a rescore of them."""
    saved = [load_saved(d, check_data=False) for d in benchmark_dirs(artifact)]
    by_name = {s.name: s for s in new_specs}
    unknown = sorted(set(by_name) - {b.spec.name for b in saved})
    if unknown:
        raise ArtifactError(f"--spec for {', '.join(unknown)}: not a benchmark of {artifact}")
    plan = [(b, rescoring_spec(b.spec, by_name.get(b.spec.name))) for b in saved]
    if any((out / spec.name).exists() for _, spec in plan):
        raise ArtifactError(f"{out} already holds a rescore of these benchmarks; use another --out")
    return plan


async def rescore_all(plan: Sequence[tuple[SavedBenchmark, BenchmarkSpec]], out: Path,
                      judges: Callable[[], VerifierPool]) -> list[dict[str, Any]]:
    """Every benchmark of `plan` rescored at once into `out`; `judges` is called (and its pool shut down after)
    only when a spec asks for the verifier's judgments."""
    pool = judges() if any(spec.verifier for _, spec in plan) else None
    try:
        if pool is not None:
            await pool.ready()
        judge = pool.judge if pool is not None else None
        return list(await asyncio.gather(*(rescore_benchmark(b, out, spec=s, judge=judge) for b, s in plan)))
    finally:
        if pool is not None:
            pool.shutdown()


def replay_specs(artifact: Path) -> list[SavedBenchmark]:
    """Every benchmark of a run, with the data checked unchanged: what `fedpool eval replay` re-runs."""
    return [load_saved(d, check_data=True) for d in benchmark_dirs(artifact)]
