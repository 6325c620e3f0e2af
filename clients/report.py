"""The table a run of evals ends with, for `fedpool demo` and `fedpool eval run | resume | replay` alike: each
benchmark's scores with their 95% bootstrap intervals, records, failed records and wall time; the requests each
server answered for each benchmark; and the run's wall time."""

from __future__ import annotations

from collections.abc import Sequence

from fedpool.clients.eval_client import EvalSummary


def answered_by_server(summaries: Sequence[EvalSummary]) -> dict[str, dict[str, int]]:
    """Server id -> benchmark -> the requests it answered for it (failed records are answered by none)."""
    answered: dict[str, dict[str, int]] = {}
    for summary in summaries:
        for server_id, count in summary.summary["by_server"].items():
            answered.setdefault(server_id, {})[summary.benchmark] = count
    return answered


def scores_table(summaries: Sequence[EvalSummary], wall_time_s: float) -> str:
    """The scores, the requests per server and the wall time, as lines of text (README.md shows one)."""
    wide = max([14, *(len(s.benchmark) + 2 for s in summaries)])
    lines = ["Scores (95% bootstrap CI)",
             f"  {'benchmark':<{wide}}{'metric':<13}{'score':>7}  {'95% CI':<16}{'n':>5}{'failed':>8}{'wall s':>9}"]
    for s in summaries:
        for score in s.summary["scores"]:
            ci = f"[{score['ci_low']:.1f}, {score['ci_high']:.1f}]"
            lines.append(f"  {s.benchmark:<{wide}}{score['metric']:<13}{score['value']:>7.1f}  {ci:<16}"
                         f"{s.summary['records']:>5}{s.summary['failed']:>8}{s.wall_time_s:>9.1f}")
    answered = answered_by_server(summaries)
    names = [s.benchmark for s in summaries]
    column = max([14, *(len(n) + 2 for n in names)])
    lines += ["", "Requests answered per server",
              "  " + f"{'server':<14}" + "".join(f"{n:>{column}}" for n in names) + f"{'total':>8}"]
    for server_id in sorted(answered):
        row = answered[server_id]
        lines.append("  " + f"{server_id:<14}" + "".join(f"{row.get(n, 0):>{column}}" for n in names)
                     + f"{sum(row.values()):>8}")
    if not answered:
        lines.append("  (none: every request failed, or every record was written before)")
    evals = f"{len(names)} evaluations run concurrently" if len(names) > 1 else "1 evaluation"
    lines += ["", f"Wall time: {wall_time_s:.1f} s for {evals}"]
    return "\n".join(lines)
