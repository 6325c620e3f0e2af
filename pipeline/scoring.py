"""Turn a prediction into a finished Record, and records into a benchmark's scores."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from fedpool.pipeline.loaders import Sample
from fedpool.pipeline.metrics import METRICS, Score, aggregate, aggregate_corpus, score_sample, worst_value
from fedpool.pipeline.postprocess import apply_postprocess, split_reasoning
from fedpool.pipeline.prompts import build_messages, render
from fedpool.pipeline.schema import Output, Provenance, Record, TextOutput
from fedpool.pipeline.spec import BenchmarkSpec


def finish_record(
    spec: BenchmarkSpec,
    sample: Sample,
    raw_text: str | None,
    provenance: Provenance,
    *,
    reasoning: str | None = None,
) -> Record:
    """Post-process and score one sample. A failed request (raw_text None) scores the worst value."""
    record = Record(
        benchmark=spec.name,
        sample_id=sample.sample_id,
        messages=build_messages(spec, sample),
        prompt=render(spec, sample) if spec.prompt.style == "completion" else None,
        label=list(sample.labels),
        sample=dict(sample.fields),
        provenance=provenance,
    )
    return rescore_record(spec, record, raw_text, reasoning=reasoning)


def rescore_record(
    spec: BenchmarkSpec, record: Record, raw_text: str | None, *, reasoning: str | None = None
) -> Record:
    if raw_text is None:
        metrics = {name: worst_value(name) for name in spec.metrics}
        return record.model_copy(update={"output": Output(), "metrics": metrics})
    answer, think = split_reasoning(raw_text)
    post = apply_postprocess(answer, spec.postprocess, record.sample)
    output = Output(
        text=TextOutput(prediction=[raw_text], prediction_postprocessed=[post]),
        reasoning_content=reasoning if reasoning is not None else think,
    )
    return record.model_copy(update={"output": output, "metrics": score_sample(post, record.label, spec.metrics)})


def _benchmark_score(name: str, records: Sequence[Record], seed: int) -> Score:
    if METRICS[name].corpus is not None:  # corpus statistic; a failed record counts with an empty answer
        pairs = [(_final_answer(r), r.label) for r in records]
        return aggregate_corpus(name, pairs, seed=seed)
    return aggregate(name, [r.metrics.get(name, worst_value(name)) for r in records], seed=seed)


def _final_answer(record: Record) -> str:
    post = record.output.text.prediction_postprocessed
    return post[0] if post else ""


def summarize_records(spec: BenchmarkSpec, records: Sequence[Record], *, seed: int = 0) -> dict[str, Any]:
    """Scores with CIs over every record (failed ones included at their worst value), and counts."""
    scores = [_benchmark_score(name, records, seed) for name in spec.metrics]
    if spec.verifier:  # failed or unjudged records count as 0, never dropped
        scores.append(aggregate("verifier", [r.metrics.get("verifier", 0.0) for r in records], seed=seed))
    failed = [r for r in records if r.failed]
    unparsed = [
        r for r in records
        if not r.failed and r.output.text.prediction_postprocessed and not r.output.text.prediction_postprocessed[0]
    ]
    by_server = Counter(r.provenance.server_id for r in records if r.provenance.server_id and not r.failed)
    latencies = sorted(r.provenance.latency_s for r in records if r.provenance.latency_s is not None)
    return {
        "benchmark": spec.name,
        "records": len(records),
        "failed": len(failed),
        "unparsed": len(unparsed),
        "scores": [s.as_dict() for s in scores],
        "by_server": dict(sorted(by_server.items())),
        "retried": sum(1 for r in records if r.provenance.attempts > 1),
        "latency_p50_s": latencies[len(latencies) // 2] if latencies else None,
        "errors": dict(Counter(r.provenance.error_kind for r in failed if r.provenance.error_kind)),
        "verifier_unparsed": sum(1 for r in records if r.verifier is not None and not r.verifier.get("parsed")),
    }
