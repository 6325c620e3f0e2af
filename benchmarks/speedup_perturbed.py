"""Federated makespan against the ideal in worlds routing has never seen: each emulated server's prefill and
decode costs scaled by independent seeded factors in [0.7, 1.3] (`perturb_seed`), a different world per seed.

    python -m fedpool.benchmarks.speedup_perturbed --pool benchmarks/configs/table7_pool.yaml \\
        --evals benchmarks/configs/table7_evals.yaml --seeds 1 2 3

Routing starts from the same data-sheet priors in every world and learns the rest from the answers it sees;
the ideal and the oracle static split are computed with the perturbed (true) costs. Writes
benchmarks/results/speedup_perturbed.md, ending with `result: seeds=N vs_ideal_max=X`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import tempfile
from pathlib import Path

from fedpool.benchmarks.report import RESULTS_DIR, markdown_table, write_report
from fedpool.benchmarks.speedup_engine import (
    BenchConfigError,
    SpeedupReport,
    load_evals_config,
    load_pool_config,
    perturbation,
    run_speedup,
)

TARGET = 1.15  # the bound on the federated makespan over the ideal under perturbation


def body(reports: dict[int, SpeedupReport], pool_path: Path, evals_path: Path) -> str:
    first = next(iter(reports.values()))
    servers = [s.id for s in first.pool.emulated]
    lines = [
        f"Pool `{pool_path}` ({len(servers)} emulated servers, time scale {first.pool.time_scale:g}); evals "
        f"`{evals_path}` ({len(first.evals)} evals, {sum(p.size for p in first.evals)} requests); "
        f"{len(first.runs)} run(s) of the federated arm per seed (median).",
        "",
        "Each seed scales every server's prefill cost and decode cost (and its KV reads) by its own factors, "
        "drawn independently in [0.7, 1.3]; routing's priors stay the data sheets' and it is never told the "
        "factors. The ideal (the LP optimum of fractional work over servers, with the true per-request costs "
        "and the federated run's measured token counts) and the oracle static split (whole evals or shards, "
        "same costs) are computed in the perturbed world.",
        "",
        "## Perturbation factors (prefill × / decode ×)",
        "",
        markdown_table(["seed", *servers],
                       [[seed, *(f"{p:.2f} / {d:.2f}" for p, d in (perturbation(seed, s) for s in servers))]
                        for seed in reports]),
        "",
        "## Makespans",
        "",
        markdown_table(
            ["seed", "federated (s)", "runs (s)", "ideal (s)", "vs ideal", "best static split (s)",
             "best split vs ideal"],
            [[seed, f"{r.federated.makespan_s:.1f}",
              ", ".join(f"{run['federated'].makespan_s:.1f}" for run in r.runs),
              f"{r.ideal_s:.1f}" if r.ideal_s else "-", f"{r.vs_ideal:.3f}" if r.vs_ideal else "-",
              f"{r.best_split_s:.1f}" if r.best_split_s else "-",
              f"{r.best_split_vs_ideal:.3f}" if r.best_split_vs_ideal else "-"]
             for seed, r in reports.items()]),
        "",
    ]
    worst_seed, worst = max(reports.items(), key=lambda kv: kv[1].vs_ideal or 0.0)
    values = [r.vs_ideal for r in reports.values() if r.vs_ideal]
    verdict = "within" if worst.vs_ideal is not None and worst.vs_ideal <= TARGET else "outside"
    lines += [
        f"Worst world: seed {worst_seed}, federated {worst.federated.makespan_s:.1f} s against an ideal of "
        f"{worst.ideal_s or 0:.1f} s ({worst.vs_ideal or 0:.3f}×), {verdict} the {TARGET:.2f}× bound; median over "
        f"the seeds {statistics.median(values):.3f}×." if values else "No ideal: the pool is not emulated.",
        "",
        "## Where each eval ran (worst seed, requests per server)",
        "",
        markdown_table(["eval", *worst.federated.server_ids],
                       [[name, *(o.servers.get(s, 0) for s in worst.federated.server_ids)]
                        for name, o in worst.federated.evals.items()]),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="speedup_perturbed", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--pool", type=Path, default=Path("benchmarks/configs/table7_pool.yaml"))
    parser.add_argument("--evals", type=Path, default=Path("benchmarks/configs/table7_evals.yaml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--repeats", type=int, default=1, help="federated runs per seed (median)")
    parser.add_argument("--name", default="speedup_perturbed")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        pool = load_pool_config(args.pool)
        evals = load_evals_config(args.evals).model_copy(update={"repeats": args.repeats})
        if not pool.is_emulated:
            raise BenchConfigError(f"{args.pool}: perturbation applies to emulated pools only")
        if not 1 <= args.repeats <= 20:
            raise BenchConfigError(f"--repeats {args.repeats}: expected 1 to 20")
    except BenchConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    reports: dict[int, SpeedupReport] = {}
    with tempfile.TemporaryDirectory(prefix="fedpool-perturbed-") as tmp:
        for seed in args.seeds:
            world = pool.model_copy(update={"perturb_seed": seed})
            report = asyncio.run(run_speedup(world, evals, Path(tmp) / f"seed{seed}", arms=["federated"]))
            reports[seed] = report
            print(f"[perturbed] seed {seed}: federated {report.federated.makespan_s:.1f} s, ideal "
                  f"{report.ideal_s or 0:.1f} s, vs ideal {report.vs_ideal or 0:.3f}", flush=True)
    worst = max((r.vs_ideal or 0.0) for r in reports.values())
    result = {"seeds": len(reports), "vs_ideal_max": f"{worst:.3f}"}
    path = write_report(args.name, "Speedup under perturbation: federated vs the ideal in unseen worlds",
                        body(reports, args.pool, args.evals), result, results_dir=args.results_dir)
    print(f"report: {path}")
    print("result: " + " ".join(f"{k}={v}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
