"""Per-sample metrics and benchmark scores with bootstrap confidence intervals."""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jiwer

BOOTSTRAP_RESAMPLES = 1000
CI_LEVEL = 0.95


def _norm(text: str) -> str:
    return " ".join(re.sub(r"[\s]+", " ", text.strip().lower()).strip(" .,;:!?\"'").split())


def exact_match(prediction: str, labels: Sequence[str]) -> float:
    """1.0 when the prediction equals any label after lower-casing and trimming edge punctuation."""
    pred = _norm(prediction)
    return float(any(pred == _norm(label) for label in labels))


def accuracy(prediction: str, labels: Sequence[str]) -> float:
    """Strict equality with any label (for already-normalised answers such as option letters)."""
    return float(prediction in labels)


def token_f1(prediction: str, labels: Sequence[str]) -> float:
    """SQuAD-style token F1 against the best label."""
    pred = _norm(prediction).split()
    best = 0.0
    for label in labels:
        gold = _norm(label).split()
        common = sum((Counter(pred) & Counter(gold)).values())
        if not pred or not gold or common == 0:
            best = max(best, float(pred == gold))
            continue
        precision, recall = common / len(pred), common / len(gold)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


def wer(prediction: str, labels: Sequence[str]) -> float:
    """Word error rate (jiwer) against the first label; lower is better."""
    return float(jiwer.wer(labels[0] or " ", prediction or " "))


def cer(prediction: str, labels: Sequence[str]) -> float:
    return float(jiwer.cer(labels[0] or " ", prediction or " "))


@dataclass(frozen=True, slots=True)
class MetricDef:
    fn: Callable[[str, Sequence[str]], float]
    higher_is_better: bool = True
    scale: float = 100.0  # scores are reported in percent


METRICS: dict[str, MetricDef] = {
    "exact_match": MetricDef(exact_match),
    "accuracy": MetricDef(accuracy),
    "f1": MetricDef(token_f1),
    "wer": MetricDef(wer, higher_is_better=False),
    "cer": MetricDef(cer, higher_is_better=False),
}


def score_sample(prediction: str, labels: Sequence[str], metric_names: Sequence[str]) -> dict[str, float]:
    return {name: METRICS[name].fn(prediction, labels) for name in metric_names}


@dataclass(frozen=True, slots=True)
class Score:
    metric: str
    value: float
    ci_low: float
    ci_high: float
    n: int

    def as_dict(self) -> dict[str, float | int | str]:
        return {"metric": self.metric, "value": self.value, "ci_low": self.ci_low, "ci_high": self.ci_high, "n": self.n}


def aggregate(metric: str, values: Sequence[float], *, seed: int = 0) -> Score:
    """Mean (in percent) with a percentile bootstrap CI. Failed samples must be passed in as their
    worst value, never left out: dropping them would inflate the score."""
    scale = METRICS[metric].scale if metric in METRICS else 100.0  # e.g. 'verifier' (0/1 per record)
    n = len(values)
    if n == 0:
        return Score(metric, float("nan"), float("nan"), float("nan"), 0)
    mean = sum(values) / n
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(values, k=n)) / n for _ in range(BOOTSTRAP_RESAMPLES))
    lo_idx = int((1 - CI_LEVEL) / 2 * BOOTSTRAP_RESAMPLES)
    hi_idx = min(BOOTSTRAP_RESAMPLES - 1, int((1 + CI_LEVEL) / 2 * BOOTSTRAP_RESAMPLES))
    return Score(metric, mean * scale, means[lo_idx] * scale, means[hi_idx] * scale, n)


def worst_value(metric: str) -> float:
    return 0.0 if METRICS[metric].higher_is_better else 1.0
