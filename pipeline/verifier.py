"""The verifier (OmniEvaluator §4.2, Appendix C): a small GGUF judge on CPU, run by llama-cpp-python on a
pool of Ray CPU actors that each load the model once. It judges (question, options, reference, prediction)
and answers in the paper's format, a short explanation then `Rating: 0|1`; the verdict is the last
`Rating: 0|1` at a line end. Unparseable answers are counted and reported, and score 0 (dropping them
would inflate the score)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from fedpool.pipeline.actors import cpu_actor_options
from fedpool.pipeline.postprocess import OPTION_LETTERS
from fedpool.pipeline.schema import Record

_RATING = re.compile(r"Rating:\s*([01])\s*$", re.MULTILINE)
CUT_MARK = " […] "

# Two worked examples first: a base model (no chat template) then continues in the same shape.
JUDGE_TEMPLATE = """You grade answers. Compare the prediction with the reference answer and decide whether the \
prediction is correct.

Question: What is the capital of Peru?
Reference: Lima
Prediction: The capital is Lima.
Explanation: The prediction names Lima, which matches the reference.
Rating: 1

Question: What is 7 + 8?
Reference: 15
Prediction: 14
Explanation: The prediction says 14 but the reference is 15.
Rating: 0

Question: {question}
{options}Reference: {reference}
Prediction: {prediction}
Explanation:"""


class VerifierConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model_path: str
    actors: int = Field(default=1, ge=1, le=64)
    threads: int = Field(default=1, ge=1, le=64)  # per actor
    n_ctx: int = Field(default=2048, ge=256)
    max_tokens: int = Field(default=64, ge=8, le=1024)
    field_chars: int = Field(default=800, ge=64)  # longer fields are cut head + tail
    # The judges run on the cores the inference engines use (CPU engines on this machine, as in the local
    # pool): a judgment then costs the pool what an inference call costs, and client_order="shortest_first"
    # counts an eval's judge calls in the work it has left. Off for GPU pools, where judging overlaps
    # inference instead of competing with it.
    shares_engine_cores: bool = False


@dataclass(frozen=True, slots=True)
class JudgeItem:
    question: str
    reference: str
    prediction: str
    options: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Judgment:
    rating: int | None  # None: the judge's answer had no `Rating: 0|1` line
    explanation: str
    raw: str


def judge_item(record: Record) -> JudgeItem:
    """What the judge sees of a finished record: the question as asked, options A–J if the sample has
    them, the first reference, and the raw prediction (not the post-processed one)."""
    question = record.prompt or " ".join(
        part.value for m in record.messages if m.role == "user" for part in m.content if part.type == "text"
    )
    options = tuple(f"{letter}. {record.sample[letter]}" for letter in OPTION_LETTERS if letter in record.sample)
    prediction = record.output.text.prediction[0] if record.output.text.prediction else ""
    return JudgeItem(question=question, reference=record.label[0] if record.label else "", prediction=prediction,
                     options=options)


def with_judgment(record: Record, judgment: Judgment | None) -> Record:
    """The record with its verdict: metrics['verifier'] is 1.0 or 0.0 (unparseable or failed judge: 0.0)."""
    verdict = {"rating": judgment.rating if judgment else None,
               "explanation": judgment.explanation if judgment else None,
               "parsed": bool(judgment and judgment.rating is not None)}
    score = float(judgment.rating) if judgment is not None and judgment.rating is not None else 0.0
    return record.model_copy(update={"verifier": verdict, "metrics": {**record.metrics, "verifier": score}})


def cut_head_tail(text: str, limit: int) -> str:
    """Keep the start and the end of an over-long field (answers often put the verdict at the end)."""
    if len(text) <= limit:
        return text
    keep = max(1, (limit - len(CUT_MARK)) // 2)
    return text[:keep] + CUT_MARK + text[-keep:]


def judge_prompt(item: JudgeItem, field_chars: int) -> str:
    options = "".join(f"Option: {cut_head_tail(o, field_chars)}\n" for o in item.options)
    return JUDGE_TEMPLATE.format(
        question=cut_head_tail(item.question, field_chars), options=options,
        reference=cut_head_tail(item.reference, field_chars), prediction=cut_head_tail(item.prediction, field_chars),
    )


def judge_prompt_words(question_words: float, answer_words: float, options: float = 0.0) -> float:
    """About how many words a judge prompt has: the template around a question, its options (a few words
    each) and an answer."""
    return len(JUDGE_TEMPLATE.split()) + question_words + answer_words + 4 * options


def parse_judgment(text: str) -> Judgment:
    """The verdict is the last `Rating: 0|1` standing at a line end; the explanation is what precedes it."""
    # The prompt ends in "Explanation:", so the completion starts with the explanation itself.
    matches = list(_RATING.finditer(text))
    if not matches:
        return Judgment(None, text.strip(), text)
    last = matches[-1]
    return Judgment(int(last.group(1)), text[: last.start()].strip(), text)


class VerifierWorker:
    """Holds one loaded GGUF; made into a Ray actor by VerifierPool (or used in-process)."""

    def __init__(self, config: dict[str, Any]):
        from llama_cpp import Llama

        self._config = VerifierConfig.model_validate(config)
        self._llm = Llama(model_path=self._config.model_path, n_ctx=self._config.n_ctx,
                          n_threads=self._config.threads, n_threads_batch=self._config.threads, verbose=False)

    def ready(self) -> bool:
        return True

    def judge(self, items: Sequence[JudgeItem]) -> list[Judgment]:
        out = []
        for item in items:
            completion = self._llm(judge_prompt(item, self._config.field_chars), max_tokens=self._config.max_tokens,
                                   temperature=0.0, stop=["\n\nQuestion:", "\nQuestion:"])
            if isinstance(completion, Iterator):  # only with stream=True, which is never asked for here
                raise TypeError("llama_cpp returned a stream for a non-streaming completion")
            out.append(parse_judgment(completion["choices"][0]["text"]))
        return out


class VerifierPool:
    """N Ray CPU actors, each loading the judge once; items go to the least busy actor."""

    def __init__(self, config: VerifierConfig):
        import ray

        if not Path(config.model_path).exists():
            raise FileNotFoundError(f"verifier model {config.model_path} does not exist")
        self.config = config
        # Restarted elsewhere (loading the model again) if its node dies; calls in flight are retried.
        remote = ray.remote(VerifierWorker).options(**cpu_actor_options(config.threads))
        # Ray's handles are not typed for .remote
        self._actors: list[Any] = [remote.remote(config.model_dump()) for _ in range(config.actors)]
        self._busy = [0] * len(self._actors)
        self.judged = 0
        self.unparsed = 0

    async def ready(self) -> None:
        """Wait until every judge has loaded its model (so a benchmark's clock does not time the loading)."""
        await asyncio.gather(*(actor.ready.remote() for actor in self._actors))

    async def judge(self, item: JudgeItem) -> Judgment:
        index = min(range(len(self._actors)), key=self._busy.__getitem__)
        self._busy[index] += 1
        try:
            (judgment,) = await self._actors[index].judge.remote([item])
        finally:
            self._busy[index] -= 1
        self.judged += 1
        self.unparsed += judgment.rating is None
        return judgment

    async def judge_many(self, items: Sequence[JudgeItem]) -> list[Judgment]:
        return list(await asyncio.gather(*(self.judge(i) for i in items)))

    def shutdown(self) -> None:
        import ray

        for actor in self._actors:
            ray.kill(actor)
