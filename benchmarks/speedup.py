"""Wall-time speedup of federated over conventional evaluation, on the same servers (`fedpool bench speedup`).

    python -m fedpool.benchmarks.speedup --pool benchmarks/configs/table7_pool.yaml \\
        --evals benchmarks/configs/table7_evals.yaml --name speedup_emulated

Writes benchmarks/results/NAME.md (command, machine, date, pool, evals, both arms, the ideal) with PNG
charts beside it, and ends with `result: speedup_avg=… speedup_min=… [vs_ideal=…]`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
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

# OmniEvaluator (Table 7): modality averages over four models, conventional → federated.
PAPER_MODALITY_SPEEDUP = {"text": 1.51, "image": 2.53, "video": 1.59}
PAPER_AVERAGE = 1.9


def _fmt(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def body(report: SpeedupReport, pool_path: Path, evals_path: Path, charts: list[str]) -> str:
    pool, conv, fed = report.pool, report.conventional, report.federated
    scale = pool.time_scale
    lines = [
        f"Pool `{pool_path}`, evals `{evals_path}`. Both arms run on a freshly started pool "
        f"(no cache carried over); conventional first. "
        + (f"Emulated engines at time scale {scale:g}: engine seconds = wall seconds × {scale:g}."
           if pool.is_emulated else "Real engines: wall seconds are engine seconds."),
        "",
        "## Pool",
        "",
    ]
    if pool.is_emulated:
        rows = [[s.id, s.profile, s.accelerator, p.max_running, f"{p.decode_s_per_token * 1e3:.1f}",
                 f"{p.prefill_s_per_token * 1e3:.3f}", p.kv_cache_tokens, p.protocol]
                for s in pool.emulated for p in [report.profiles[s.id]]]
        lines.append(markdown_table(
            ["server", "profile", "GPU", "max running", "decode step ms", "prefill ms/token", "KV tokens", "protocol"],
            rows))
        lines += ["", "Profile sources:", ""]
        for name in sorted({s.profile for s in pool.emulated}):
            profile = next(report.profiles[s.id] for s in pool.emulated if s.profile == name)
            lines.append(f"- `{name}`: {profile.source}")
    elif pool.local_llamacpp is not None:
        local = pool.local_llamacpp
        lines.append(markdown_table(
            ["server", "engine", "accelerator", "slots", "threads", "context per slot"],
            [[sid, "llama.cpp (started here)", "cpu", local.slots, local.threads, local.ctx_per_slot]
             for sid in fed.server_ids]))
    else:
        lines.append(markdown_table(["server", "engine", "accelerator", "url"],
                                    [[s.id, s.engine.value, s.accelerator, s.url] for s in pool.servers]))
    cfg = report.evals_config
    lines += [
        "", "## Evals", "",
        f"Conventional: static batches of {cfg.batch_size}, loading before each batch, scoring after inference, "
        f"each eval on its own server(s). Federated: all evals at once, "
        + ("routed by the dispatcher's plan (`planned: true`), " if cfg.planned else f"policy `{cfg.policy}`, ")
        + f"client order `{cfg.client_order}`, "
        f"{cfg.stage_actors} CPU stage actors, up to {cfg.concurrency} requests in flight per eval.",
        "",
    ]
    rows = []
    for p in report.evals:
        c = p.costs
        ptok, ctok = fed.tokens.get(p.spec.name, (0.0, 0.0))
        rows.append([p.spec.name, p.modality, p.size, f"{ptok:.0f}", f"{ctok:.0f}", p.spec.generation.max_tokens,
                     f"{c.load_s * 1e3:g}", f"{(c.metric_s + c.verify_s) * 1e3:g}",
                     ", ".join(conv.assignment.get(p.spec.name, []))])
    lines.append(markdown_table(
        ["eval", "modality", "size", "prompt tok (mean)", "answer tok (mean)", "max_tokens", "load ms/item",
         "score+verify ms/item", "conventional servers"], rows))
    lines += ["", "## Wall time", ""]
    if len(report.runs) > 1:
        lines += [f"Medians over {len(report.runs)} runs of both arms (arms alternating); every run is listed "
                  "under \"Runs\" below. Busy shares and token counts are from the run with the median makespan.",
                  ""]
    rows = []
    for p in report.evals:
        name = p.spec.name
        ce, fe = conv.evals[name], fed.evals[name]
        same = "yes" if ce.score == fe.score else f"no ({_fmt(ce.score)} vs {_fmt(fe.score)})"
        rows.append([name, p.modality, f"{ce.wall_s:.1f}", f"{fe.wall_s:.1f}", f"{ce.wall_s * scale:.0f}",
                     f"{fe.wall_s * scale:.0f}", f"**{report.speedup(name):.2f}×**",
                     f"{ce.records}/{fe.records}", f"{ce.failed}/{fe.failed}", same])
    rows.append(["**all (makespan)**", "", f"{conv.makespan_s:.1f}", f"{fed.makespan_s:.1f}",
                 f"{conv.makespan_s * scale:.0f}", f"{fed.makespan_s * scale:.0f}",
                 f"**{report.makespan_speedup:.2f}×**", "", "", ""])
    lines.append(markdown_table(
        ["eval", "modality", "conventional wall s", "federated wall s", "conventional engine s", "federated engine s",
         "speedup", "records conv/fed", "failed conv/fed", "same score"], rows))
    lines += ["", f"Speedup, mean over evals: **{report.speedup_avg:.2f}×** (min {report.speedup_min:.2f}×); "
              f"makespan speedup {report.makespan_speedup:.2f}×."]
    if len(report.runs) > 1:
        lines += ["", "### Runs", "", "Wall seconds, conventional / federated, and each run's own speedups.", ""]
        names = [p.spec.name for p in report.evals]
        rows = []
        for i, (c, f) in enumerate(report.runs, 1):
            each = [c.evals[n].wall_s / max(f.evals[n].wall_s, 1e-9) for n in names]
            rows.append([i, *(f"{c.evals[n].wall_s:.1f} / {f.evals[n].wall_s:.1f}" for n in names),
                         f"{c.makespan_s:.1f} / {f.makespan_s:.1f}", f"{sum(each) / len(each):.2f}×",
                         f"{min(each):.2f}×"])
        lines.append(markdown_table(["run", *names, "makespan", "mean speedup", "min speedup"], rows))
    by_mod: dict[str, list[float]] = {}
    for p in report.evals:
        by_mod.setdefault(p.modality, []).append(report.speedup(p.spec.name))
    rows = [[m, f"{sum(v) / len(v):.2f}×", f"{PAPER_MODALITY_SPEEDUP[m]:.2f}×" if m in PAPER_MODALITY_SPEEDUP else "–"]
            for m, v in sorted(by_mod.items())]
    rows.append(["average", f"{report.speedup_avg:.2f}×", f"{PAPER_AVERAGE:.2f}×"])
    lines += ["", "Beside the OmniEvaluator paper (Table 7, modality averages over four models, real GPUs):", "",
              markdown_table(["modality", "fedpool (this run)", "OmniEvaluator"], rows)]
    if report.ideal_s is not None:
        lines += [
            "", "## Against the ideal", "",
            f"Ideal makespan: total work ÷ the pool's saturated throughput, as a linear program over eval × server "
            f"(each request costs its prefill plus its share of full decode steps on that server; token counts from "
            f"the federated records): **{report.ideal_s:.1f} s wall** ({report.ideal_s * scale:.0f} engine s). "
            f"Federated makespan ÷ ideal = **{_fmt(report.vs_ideal, 3)}**; conventional ÷ ideal = "
            f"{conv.makespan_s / report.ideal_s:.2f}.",
        ]
        if report.ideal_plan:
            servers = sorted(next(iter(report.ideal_plan.values())))
            rows = [[e, *[f"{report.ideal_plan[e][s]:.0f}" for s in servers],
                     *[str(fed.evals[e].servers.get(s, 0)) for s in servers]] for e in sorted(report.ideal_plan)]
            lines += ["", "Requests per server, ideal plan vs what the dispatcher did:", "",
                      markdown_table(["eval", *[f"ideal {s}" for s in servers], *[f"fedpool {s}" for s in servers]],
                                     rows)]
    lines += ["", "## Server busy share", "",
              "Share of metric samples (every 0.1 s, from each engine's own /metrics) with at least one request "
              "running, and the mean running count, over each arm's makespan.", ""]
    rows = []
    emulated = bool(fed.engine_busy_s)
    for sid in fed.server_ids:
        row = [sid, f"{conv.busy.busy_share(sid, conv.makespan_s):.0%}",
               f"{conv.busy.mean_running(sid, conv.makespan_s):.1f}",
               f"{fed.busy.busy_share(sid, fed.makespan_s):.0%}",
               f"{fed.busy.mean_running(sid, fed.makespan_s):.1f}"]
        if emulated:  # the emulated GPU's own count of seconds spent computing, against the makespan
            row += [f"{conv.engine_busy_s.get(sid, 0.0) / (conv.makespan_s * scale):.0%}",
                    f"{fed.engine_busy_s.get(sid, 0.0) / (fed.makespan_s * scale):.0%}"]
        rows.append(row)
    headers = ["server", "conventional busy", "conventional mean running", "federated busy", "federated mean running"]
    if emulated:
        headers += ["conventional GPU computing", "federated GPU computing"]
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
    names = [p.spec.name for p in report.evals]
    conv = [report.conventional.evals[n].wall_s for n in names]
    fed = [report.federated.evals[n].wall_s for n in names]
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], conv, width=0.4, label="conventional")
    ax.bar([x + 0.2 for x in xs], fed, width=0.4, label="federated (fedpool)")
    for x, n in zip(xs, names, strict=True):
        ax.annotate(f"{report.speedup(n):.1f}×", (x + 0.2, report.federated.evals[n].wall_s), ha="center",
                    va="bottom", fontsize=9)
    if report.ideal_s is not None:
        ax.axhline(report.ideal_s, color="grey", linestyle="--", linewidth=1, label="ideal makespan")
    ax.set_xticks(list(xs), names, rotation=15)
    ax.set_ylabel("wall time (s)")
    ax.set_title(f"{name}: per-eval wall time")
    ax.legend()
    fig.tight_layout()
    path = results_dir / f"{name}_walltime.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    charts.append(path.name)

    arms: list[ArmResult] = [report.conventional, report.federated]
    servers = report.federated.server_ids
    fig, axes = plt.subplots(len(servers), 2, figsize=(11, 1.6 * len(servers) + 1), sharex=True, squeeze=False)
    horizon = max(a.makespan_s for a in arms)
    for col, arm in enumerate(arms):
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fedpool bench speedup", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pool", type=Path, required=True, help="pool YAML (emulated, servers or local_llamacpp)")
    parser.add_argument("--evals", type=Path, required=True, help="evals YAML")
    parser.add_argument("--name", default="speedup", help="report name: results/NAME.md (default speedup)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--work-dir", type=Path, help="where both arms write artifacts (default: a temp dir)")
    parser.add_argument("--repeats", type=int, help="run both arms this many times and report medians "
                        "(default: the evals file's `repeats`, else 1)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        pool = load_pool_config(args.pool)
        evals = load_evals_config(args.evals)
        if args.repeats is not None:
            if not 1 <= args.repeats <= 20:
                raise BenchConfigError(f"--repeats {args.repeats}: expected 1 to 20")
            evals = evals.model_copy(update={"repeats": args.repeats})
    except BenchConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="fedpool-speedup-") as tmp:
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
        work = (args.work_dir or Path(tmp)) / f"{args.name}-{stamp}"  # a fresh directory: never resumes
        print(f"[bench] {len(evals.evals)} evals on {args.pool}: conventional arm, then federated arm", flush=True)
        try:
            report = asyncio.run(run_speedup(pool, evals, work))
        except BenchConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    args.results_dir.mkdir(parents=True, exist_ok=True)
    charts = plot(report, args.name, args.results_dir)
    result: dict[str, object] = {"speedup_avg": f"{report.speedup_avg:.2f}", "speedup_min": f"{report.speedup_min:.2f}"}
    if report.vs_ideal is not None:
        result["vs_ideal"] = f"{report.vs_ideal:.3f}"
    text = body(report, args.pool, args.evals, charts)
    path = write_report(args.name, f"Speedup: federated vs conventional ({args.name})", text, result,
                        results_dir=args.results_dir)
    for p in report.evals:
        n = p.spec.name
        print(f"  {n:<18} conventional {report.conventional.evals[n].wall_s:7.1f} s   "
              f"federated {report.federated.evals[n].wall_s:7.1f} s   {report.speedup(n):5.2f}×")
    conv_s, fed_s = report.conventional.makespan_s, report.federated.makespan_s
    ideal = f", ideal {report.ideal_s:.1f} s" if report.ideal_s else ""
    print(f"  makespan: conventional {conv_s:.1f} s, federated {fed_s:.1f} s{ideal}")
    print(f"report: {path}")
    print("result: " + " ".join(f"{k}={v}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
