"""Per-sample metrics and benchmark scores with bootstrap confidence intervals.

Most scores are the mean of per-sample values. WER, CER and BLEU are corpus statistics, as their
reference implementations define them: total edits over total reference words (characters), and BLEU
from n-gram counts summed over the corpus (sacrebleu). Each sample keeps its own value in its record;
the benchmark score is computed from per-sample sufficient statistics, so the bootstrap resamples
samples and recomputes the corpus statistic for each resample.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

# numpy, jiwer, sacrebleu and rapidfuzz are imported where they are used: CPU that every eval process paid at
# its start (processes starting at once on shared cores wait for each other's imports), though most benchmarks
# score by exact match and numpy is needed only for the summary at the end.

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
    import jiwer

    return float(jiwer.wer(labels[0] or " ", prediction or " "))


def cer(prediction: str, labels: Sequence[str]) -> float:
    import jiwer

    return float(jiwer.cer(labels[0] or " ", prediction or " "))


def _word_edits(prediction: str, labels: Sequence[str]) -> tuple[float, ...]:
    import jiwer

    out = jiwer.process_words(labels[0] or " ", prediction or " ")
    return (float(out.substitutions + out.deletions + out.insertions), float(len((labels[0] or " ").split())))


def _char_edits(prediction: str, labels: Sequence[str]) -> tuple[float, ...]:
    import jiwer

    out = jiwer.process_characters(labels[0] or " ", prediction or " ")
    return (float(out.substitutions + out.deletions + out.insertions), float(len(labels[0] or " ")))


def _edit_rate(totals: Sequence[float]) -> float:
    return totals[0] / totals[1] if totals[1] else 0.0


def bleu(prediction: str, labels: Sequence[str]) -> float:
    """Sentence BLEU (sacrebleu, exponential smoothing) against every label, on [0, 1]."""
    import sacrebleu

    return float(sacrebleu.sentence_bleu(prediction, list(labels)).score / 100.0)


def _bleu_stats(prediction: str, labels: Sequence[str]) -> tuple[float, ...]:
    """sacrebleu's sufficient statistics of one sentence: 4 matching n-gram counts, 4 totals, lengths."""
    import sacrebleu

    s = sacrebleu.sentence_bleu(prediction, list(labels))
    return (*map(float, s.counts), *map(float, s.totals), float(s.sys_len), float(s.ref_len))


def _corpus_bleu(totals: Sequence[float]) -> float:
    """Corpus BLEU from summed statistics, as sacrebleu.corpus_bleu computes it (no smoothing), on [0, 1]."""
    from sacrebleu.metrics.bleu import BLEU

    whole = [round(float(x)) for x in totals]
    return float(BLEU.compute_bleu(whole[:4], whole[4:8], whole[8], whole[9], smooth_method="none").score / 100.0)


ANLS_THRESHOLD = 0.5


def anls(prediction: str, labels: Sequence[str]) -> float:
    """Average Normalized Levenshtein Similarity (DocVQA, Biten et al. 2019) of one answer: the best over
    labels of 1 − NL, where NL = edit distance / length of the longer string after lower-casing and
    collapsing whitespace; 0 when NL ≥ 0.5 (the threshold τ of the paper)."""
    from rapidfuzz.distance import Levenshtein

    pred = " ".join(prediction.lower().split())
    best = 0.0
    for label in labels:
        gold = " ".join(label.lower().split())
        nl = Levenshtein.normalized_distance(pred, gold)
        best = max(best, 1.0 - nl if nl < ANLS_THRESHOLD else 0.0)
    return best


@dataclass(frozen=True, slots=True)
class CorpusForm:
    """A corpus statistic: additive per-sample statistics and the function of their sums."""

    stats: Callable[[str, Sequence[str]], tuple[float, ...]]
    reduce: Callable[[Sequence[float]], float]
    # The same function over many rows of sums at once (R × k -> R), where it vectorizes; else row by row.
    reduce_rows: Callable[[np.ndarray], np.ndarray] | None = None

    def rows(self, sums: np.ndarray) -> np.ndarray:
        if self.reduce_rows is not None:
            return self.reduce_rows(sums)
        import numpy as np

        return np.fromiter((self.reduce(row) for row in sums), dtype=float, count=len(sums))


def _edit_rates(sums: np.ndarray) -> np.ndarray:
    import numpy as np

    refs = sums[:, 1]
    return np.divide(sums[:, 0], refs, out=np.zeros(len(sums)), where=refs > 0)


@dataclass(frozen=True, slots=True)
class MetricDef:
    fn: Callable[[str, Sequence[str]], float]
    higher_is_better: bool = True
    scale: float = 100.0  # scores are reported in percent
    corpus: CorpusForm | None = None  # the benchmark score is this corpus statistic, not the mean


METRICS: dict[str, MetricDef] = {
    "exact_match": MetricDef(exact_match),
    "accuracy": MetricDef(accuracy),
    "f1": MetricDef(token_f1),
    "wer": MetricDef(wer, higher_is_better=False, corpus=CorpusForm(_word_edits, _edit_rate, _edit_rates)),
    "cer": MetricDef(cer, higher_is_better=False, corpus=CorpusForm(_char_edits, _edit_rate, _edit_rates)),
    "bleu": MetricDef(bleu, corpus=CorpusForm(_bleu_stats, _corpus_bleu)),
    "anls": MetricDef(anls),
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


def bootstrap(stats: np.ndarray, reduce_rows: Callable[[np.ndarray], np.ndarray], *, seed: int = 0,
              resamples: int = BOOTSTRAP_RESAMPLES) -> tuple[float, float, float]:
    """(statistic, CI low, CI high): the statistic of the summed per-sample statistics (`stats`, n × k), and
    its percentile interval over `resamples` resamples of the samples with replacement. Vectorized: the
    resamples are index matrices drawn in blocks (bounded memory), summed with numpy, reduced row-wise."""
    import numpy as np

    n, k = stats.shape
    rng = np.random.default_rng(seed)
    value = float(reduce_rows(stats.sum(axis=0, keepdims=True))[0])
    values = np.empty(resamples)
    block = max(1, min(resamples, 4_000_000 // max(1, n * k)))
    for start in range(0, resamples, block):
        size = min(block, resamples - start)
        values[start:start + size] = reduce_rows(stats[rng.integers(0, n, (size, n))].sum(axis=1))
    values.sort()
    lo = values[int((1 - CI_LEVEL) / 2 * resamples)]
    hi = values[min(resamples - 1, int((1 + CI_LEVEL) / 2 * resamples))]
    return value, float(lo), float(hi)


def aggregate(metric: str, values: Sequence[float], *, seed: int = 0) -> Score:
    """Mean (in percent) with a percentile bootstrap CI. Failed samples must be passed in as their
    worst value, never left out: dropping them would inflate the score."""
    scale = METRICS[metric].scale if metric in METRICS else 100.0  # e.g. 'verifier' (0/1 per record)
    n = len(values)
    if n == 0:
        return Score(metric, float("nan"), float("nan"), float("nan"), 0)
    import numpy as np

    mean, lo, hi = bootstrap(np.asarray(values, dtype=float).reshape(n, 1), lambda sums: sums[:, 0] / n, seed=seed)
    return Score(metric, mean * scale, lo * scale, hi * scale, n)


def aggregate_corpus(metric: str, pairs: Sequence[tuple[str, Sequence[str]]], *, seed: int = 0) -> Score:
    """A corpus metric over (prediction, labels) pairs with a percentile bootstrap CI over samples.
    Failed samples are passed in with an empty prediction (all reference words deleted), never left out."""
    form = METRICS[metric].corpus
    if form is None:
        raise ValueError(f"metric {metric!r} has no corpus form")
    scale = METRICS[metric].scale
    n = len(pairs)
    if n == 0:
        return Score(metric, float("nan"), float("nan"), float("nan"), 0)
    import numpy as np

    stats = np.array([form.stats(pred, labels) for pred, labels in pairs], dtype=float)
    value, lo, hi = bootstrap(stats, form.rows, seed=seed)
    return Score(metric, value * scale, lo * scale, hi * scale, n)


def worst_value(metric: str) -> float:
    return 0.0 if METRICS[metric].higher_is_better else 1.0
