"""Wall-time speedup of federated over conventional evaluation, on the same servers (`fedpool bench speedup`).

    python -m fedpool.benchmarks.speedup --pool benchmarks/configs/table7_pool.yaml \\
        --evals benchmarks/configs/table7_evals.yaml --name speedup_emulated

Writes benchmarks/results/NAME.md (command, machine, date, pool, evals, every arm, the bounds) with PNG charts
beside it, and ends with `result: speedup_vs_strongest=… strongest=… speedup_vs_static=… vs_ideal=…
best_split_vs_ideal=… repeats=…`. The headline is the makespan against the strongest conventional arm.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from fedpool.benchmarks.report import RESULTS_DIR, markdown_table, write_report
from fedpool.benchmarks.speedup_engine import (
    ArmResult,
    BenchConfigError,
    SpeedupReport,
    load_evals_config,
    load_pool_config,
    run_speedup,
)

# OmniEvaluator (Table 7): modality averages over four models, conventional → federated, on their GPUs against
# their own per-process baseline (no script published): other hardware and another baseline than ours.
PAPER_MODALITY_SPEEDUP = {"text": 1.51, "image": 2.53, "video": 1.59}
PAPER_AVERAGE = 1.9
ARM_RENDERS = {
    "static": "lmms-eval 0.5 sync OpenAI client: batches of B, built in-process (media decoded per batch), "
              "the next after the slowest answer; scoring and judging after inference",
    "sliding": "lm-eval-harness API client (`num_concurrent`=C; also lmms-eval async, inspect_ai "
               "`max_connections`): every request built first, C in flight, refilled as each answers",
    "whole": "lm-eval-harness vLLM backend (`batch_size=auto`): every request built first, all handed to the "
             "engine at once",
    "federated-inline": "fedpool routing (every eval at once through the dispatcher), CPU work left in each "
                        "eval's own process, serially, as the conventional arms do it",
    "federated": "fedpool: every eval at once through the dispatcher, CPU work on Ray CPU actors",
}


def _fmt(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def _pool_prose(report: SpeedupReport) -> str:
    pool = report.pool
    if pool.is_emulated:
        perturbed = (f" Perturbed (seed {pool.perturb_seed}): each server's prefill and decode costs scaled by seeded "
                     "factors in [0.7, 1.3] that routing never sees." if pool.perturb_seed is not None else "")
        return (f"Emulated engines, started afresh for every arm, at time scale {pool.time_scale:g} (engine "
                f"seconds = wall seconds × {pool.time_scale:g}).{perturbed}")
    if pool.local_llamacpp is not None:
        return ("Real llama.cpp servers, started afresh on this machine for every arm (wall seconds are engine "
                "seconds).")
    return ("Servers given by URL, the same processes for every arm (not restarted: engine caches may carry over "
            "from one arm to the next); wall seconds are engine seconds.")


def body(report: SpeedupReport, pool_path: Path, evals_path: Path, charts: list[str]) -> str:
    pool, cfg, fed = report.pool, report.evals_config, report.federated
    scale = pool.time_scale
    strongest = report.strongest
    low, high = report.ratio_spread(strongest)
    lines = [
        f"Pool `{pool_path}`, evals `{evals_path}`. {_pool_prose(report)} Every arm ran {len(report.runs)} times, "
        "the arms' order reversed on every other repeat; figures are medians, spreads are the lowest and highest "
        "repeat.",
        "",
        f"**Headline: federated makespan {fed.makespan_s:.1f} s against the strongest conventional arm "
        f"(`{strongest}`, {report.arms[strongest].makespan_s:.1f} s): {report.makespan_ratio(strongest):.2f}× "
        f"(repeats {low:.2f}–{high:.2f}×).**"
        + (f" Against static batches: {report.makespan_ratio('static'):.2f}×." if "static" in report.arms else "")
        + (f" Ideal makespan {report.ideal_s:.1f} s (federated ÷ ideal = {_fmt(report.vs_ideal, 3)}); the oracle "
           f"static split {report.best_split_s:.1f} s (÷ ideal = {_fmt(report.best_split_vs_ideal, 3)})."
           if report.ideal_s and report.best_split_s else ""),
        "",
        "## Arms", "",
    ]
    rows: list[Sequence[object]] = []  # table cells of any printable kind; reused for each table below
    for arm, result in report.arms.items():
        lo, hi = report.ratio_spread(arm)
        runs = ", ".join(f"{run[arm].makespan_s:.1f}" for run in report.runs)
        rows.append([f"`{arm}`", ARM_RENDERS[arm], f"{result.makespan_s:.1f}", runs,
                     f"{report.makespan_ratio(arm):.2f}× ({lo:.2f}–{hi:.2f})",
                     _fmt(result.makespan_s / report.ideal_s if report.ideal_s else None)])
    lines.append(markdown_table(["arm", "what it renders", "makespan s (median)", "every repeat", "federated speedup",
                                 "÷ ideal"], rows))
    if "federated-inline" in report.arms:
        lines += ["", f"What moving CPU work off the critical path gains, apart from federation: federated-inline "
                      f"{report.arms['federated-inline'].makespan_s:.1f} s → federated {fed.makespan_s:.1f} s "
                      f"({report.makespan_ratio('federated-inline'):.2f}×); federation alone, strongest baseline → "
                      f"federated-inline: {report.makespan_ratio(strongest, 'federated-inline'):.2f}×."]
    lines += ["", f"Static batches of {cfg.batch_size}; the sliding window is "
              + (f"{cfg.window}" if cfg.window else "each server's capacity") + "; federated: "
              + ("routed by the dispatcher's plan (`planned: true`), " if cfg.planned else f"policy `{cfg.policy}`, ")
              + f"client order `{cfg.client_order}`, {cfg.stage_actors} CPU stage actors, up to {cfg.concurrency} "
              "requests in flight per eval. Judges, where evals have one, are loaded before the clock in every arm, "
              "with as many judge threads in the federated arms as the conventional arms' judged evals have.", ""]
    lines += ["## Pool", ""]
    if pool.is_emulated:
        rows = [[s.id, s.profile, s.accelerator, p.max_running, f"{p.decode_s_per_token * 1e3:.1f}",
                 f"{p.prefill_s_per_token * 1e3:.3f}", p.kv_cache_tokens, p.protocol]
                for s in pool.emulated for p in [report.profiles[s.id]]]
        lines.append(markdown_table(
            ["server", "profile", "GPU", "max running", "decode step ms", "prefill ms/token", "KV tokens", "protocol"],
            rows))
        lines += ["", "Profile sources:", ""]
        for s in pool.emulated:
            lines.append(f"- `{s.id}` (`{s.profile}`): {report.profiles[s.id].source}")
    elif pool.local_llamacpp is not None:
        local = pool.local_llamacpp
        lines.append(markdown_table(
            ["server", "engine", "accelerator", "slots", "threads", "context per slot"],
            [[sid, "llama.cpp (started here)", "cpu", local.slots, local.threads, local.ctx_per_slot]
             for sid in fed.server_ids]))
    else:
        lines.append(markdown_table(["server", "engine", "accelerator", "url"],
                                    [[s.id, s.engine.value, s.accelerator, s.url] for s in pool.servers]))
    first = report.arms[report.baselines[0]]
    lines += ["", "## Evals and the conventional split", "",
              "The conventional arms' split is the careful user's (`benchmarks/assignment.py`: prefill-aware, "
              "from sizes, prompt lengths, max_tokens and the servers' speeds, exact search where the pool is "
              "small); the oracle split is the same search with the true token counts.", ""]
    rows = []
    for p in report.evals:
        c = p.costs
        ptok, ctok = fed.tokens.get(p.spec.name, (0.0, 0.0))
        rows.append([p.spec.name, p.modality, p.size, f"{ptok:.0f}", f"{ctok:.0f}", p.spec.generation.max_tokens,
                     f"{c.load_s * 1e3:g}", f"{(c.metric_s + c.verify_s) * 1e3:g}", "yes" if p.spec.verifier else "",
                     ", ".join(first.assignment.get(p.spec.name, [])),
                     ", ".join((report.best_split or {}).get(p.spec.name, []))])
    lines.append(markdown_table(
        ["eval", "modality", "size", "prompt tok (mean)", "answer tok (mean)", "max_tokens", "load ms/item",
         "score+verify ms/item", "judged", "conventional servers", "oracle split"], rows))
    if report.careful_split_s and report.best_split_s:
        lines += ["", f"Predicted at saturation with the true token counts: the careful split "
                      f"{report.careful_split_s:.1f} s, the oracle split {report.best_split_s:.1f} s, the ideal "
                      f"{report.ideal_s:.1f} s."]
    lines += ["", "## Per eval", "", "Wall seconds (median over repeats) and each eval's own speedup against the "
              "strongest arm; the mean of these ratios is the second figure, after the makespan.", ""]
    arms = list(report.arms)
    rows = []
    for p in report.evals:
        name = p.spec.name
        rows.append([name, p.modality, *(f"{report.arms[a].evals[name].wall_s:.1f}" for a in arms),
                     f"{report.speedup(name):.2f}×",
                     f"{report.arms[strongest].evals[name].records}/{fed.evals[name].records}",
                     f"{report.arms[strongest].evals[name].failed}/{fed.evals[name].failed}"])
    lines.append(markdown_table(["eval", "modality", *arms, f"speedup vs {strongest}", "records", "failed"], rows))
    lines += ["", f"Mean of the per-eval speedups against `{strongest}`: {report.mean_speedup():.2f}× (min "
                  f"{min(report.speedup(p.spec.name) for p in report.evals):.2f}×)"
              + (f"; against `static`: {report.mean_speedup('static'):.2f}×." if "static" in report.arms else ".")]
    by_mod: dict[str, list[float]] = {}
    for p in report.evals:
        by_mod.setdefault(p.modality, []).append(report.speedup(p.spec.name))
    rows = [[m, f"{sum(v) / len(v):.2f}×", f"{PAPER_MODALITY_SPEEDUP[m]:.2f}×" if m in PAPER_MODALITY_SPEEDUP else "–"]
            for m, v in sorted(by_mod.items())]
    rows.append(["average", f"{report.mean_speedup():.2f}×", f"{PAPER_AVERAGE:.2f}×"])
    lines += ["", "Beside the OmniEvaluator paper's Table 7 (its modality averages over four models — other hardware, "
                  "and its own per-process baseline, not ours):", "",
              markdown_table(["modality", f"fedpool vs `{strongest}` (this run)", "OmniEvaluator (other setup)"],
                             rows)]
    if report.ideal_s is not None and report.ideal_plan:
        servers = sorted(next(iter(report.ideal_plan.values())))
        rows = [[e, *[f"{report.ideal_plan[e][s]:.0f}" for s in servers],
                 *[str(fed.evals[e].servers.get(s, 0)) for s in servers]] for e in sorted(report.ideal_plan)]
        lines += ["", "## Against the ideal", "",
                  f"Ideal makespan: total work ÷ the pool's saturated throughput, an LP over eval × server (each "
                  f"request costs its prefill plus its share of full decode steps there; token counts from the "
                  f"federated records): {report.ideal_s:.1f} s wall ({report.ideal_s * scale:.0f} engine s). "
                  "Requests per "
                  "server, the ideal plan beside what the dispatcher did:", "",
                  markdown_table(["eval", *[f"ideal {s}" for s in servers], *[f"fedpool {s}" for s in servers]], rows)]
    lines += ["", "## Server busy share", "",
              "Share of metric samples (every 0.1 s, from each engine's own /metrics) with a request running, and "
              "the mean running count, over each arm's makespan (the median repeat).", ""]
    rows = []
    compared = [strongest, "federated"]
    emulated = bool(fed.engine_busy_s)
    for sid in fed.server_ids:
        row = [sid]
        for arm in compared:
            result = report.arms[arm]
            row += [f"{result.busy.busy_share(sid, result.makespan_s):.0%}",
                    f"{result.busy.mean_running(sid, result.makespan_s):.1f}"]
            if emulated:
                row.append(f"{result.engine_busy_s.get(sid, 0.0) / (result.makespan_s * scale):.0%}")
        rows.append(row)
    headers = ["server"]
    for arm in compared:
        headers += [f"{arm} busy", f"{arm} mean running"] + ([f"{arm} GPU computing"] if emulated else [])
    lines.append(markdown_table(headers, rows))
    if emulated:
        lines += ["", "GPU computing: engine seconds the emulated engine spent in steps "
                  "(`fedpool_emulator_busy_seconds_total`) ÷ (makespan × time scale)."]
    if charts:
        lines += ["", "## Charts", ""] + [f"![{c}]({c})" for c in charts]
    return "\n".join(lines)


def plot(report: SpeedupReport, name: str, results_dir: Path) -> list[str]:
    try:
        import matplotlib
    except ModuleNotFoundError:
        print("[bench] charts skipped: matplotlib is not installed (pip install 'fedpool[bench]')", flush=True)
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    charts = []
    arms = list(report.arms)
    fig, ax = plt.subplots(figsize=(8, 4))
    spans = [report.arms[a].makespan_s for a in arms]
    ax.bar(range(len(arms)), spans, color=["#999999" if a != "federated" else "#1f77b4" for a in arms])
    for x, a in enumerate(arms):
        lo = min(run[a].makespan_s for run in report.runs)
        hi = max(run[a].makespan_s for run in report.runs)
        ax.plot([x, x], [lo, hi], color="black", linewidth=1)
    if report.ideal_s is not None:
        ax.axhline(report.ideal_s, color="grey", linestyle="--", linewidth=1, label="ideal makespan")
        ax.legend()
    ax.set_xticks(range(len(arms)), arms, rotation=15)
    ax.set_ylabel("makespan (s), median and range")
    ax.set_title(f"{name}: makespan per arm")
    fig.tight_layout()
    path = results_dir / f"{name}_walltime.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    charts.append(path.name)

    shown: list[ArmResult] = [report.arms[report.strongest], report.federated]
    servers = report.federated.server_ids
    fig, axes = plt.subplots(len(servers), 2, figsize=(11, 1.6 * len(servers) + 1), sharex=True, squeeze=False)
    horizon = max(a.makespan_s for a in shown)
    for col, arm in enumerate(shown):
        for row, sid in enumerate(servers):
            ax = axes[row][col]
            samples = arm.busy.samples.get(sid, [])
            if samples:
                ts, rs = zip(*samples, strict=True)
                ax.fill_between(ts, rs, step="post", alpha=0.6)
            ax.set_xlim(0, horizon)
            ax.set_ylabel(sid, fontsize=8)
            if row == 0:
                ax.set_title(f"{arm.mode}: requests running per server")
        axes[-1][col].set_xlabel("wall time (s)")
    fig.tight_layout()
    path = results_dir / f"{name}_timeline.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    charts.append(path.name)
    return charts


def result_of(report: SpeedupReport) -> dict[str, object]:
    return {
        "speedup_vs_strongest": f"{report.makespan_ratio(report.strongest):.2f}",
        "strongest": report.strongest,
        "speedup_vs_static": _fmt(report.makespan_ratio("static") if "static" in report.arms else None),
        "vs_ideal": _fmt(report.vs_ideal, 3),
        "best_split_vs_ideal": _fmt(report.best_split_vs_ideal, 3),
        "repeats": len(report.runs),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fedpool bench speedup", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--pool", type=Path, required=True, help="pool YAML (emulated, servers or local_llamacpp)")
    parser.add_argument("--evals", type=Path, required=True, help="evals YAML")
    parser.add_argument("--name", default="speedup", help="report name: results/NAME.md (default speedup)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--work-dir", type=Path, help="where every arm writes artifacts (default: a temp dir)")
    parser.add_argument("--repeats", type=int, help="run every arm this many times and report medians "
                        "(default: the evals file's `repeats`, else 3)")
    parser.add_argument("--perturb-seed", type=int, help="emulated pools: perturb each server's speeds (seeded)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        pool = load_pool_config(args.pool)
        evals = load_evals_config(args.evals)
        if args.repeats is not None:
            if not 1 <= args.repeats <= 20:
                raise BenchConfigError(f"--repeats {args.repeats}: expected 1 to 20")
            evals = evals.model_copy(update={"repeats": args.repeats})
        if args.perturb_seed is not None:
            pool = pool.model_copy(update={"perturb_seed": args.perturb_seed})
    except BenchConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="fedpool-speedup-") as tmp:
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
        work = (args.work_dir or Path(tmp)) / f"{args.name}-{stamp}"  # a fresh directory: never resumes
        print(f"[bench] {len(evals.evals)} evals on {args.pool}: {evals.repeats} repeats of every arm", flush=True)
        try:
            report = asyncio.run(run_speedup(pool, evals, work))
        except BenchConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    args.results_dir.mkdir(parents=True, exist_ok=True)
    charts = plot(report, args.name, args.results_dir)
    result = result_of(report)
    text = body(report, args.pool, args.evals, charts)
    path = write_report(args.name, f"Speedup: federated vs every conventional baseline ({args.name})", text, result,
                        results_dir=args.results_dir)
    for arm, arm_result in report.arms.items():
        print(f"  {arm:<17} makespan {arm_result.makespan_s:7.1f} s   federated speedup "
              f"{report.makespan_ratio(arm):5.2f}×")
    ideal = f", ideal {report.ideal_s:.1f} s" if report.ideal_s else ""
    print(f"  strongest baseline: {report.strongest}{ideal}")
    print(f"report: {path}")
    print("result: " + " ".join(f"{k}={v}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
