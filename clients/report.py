"""The table a run of evals ends with, for `fedpool demo` and `fedpool eval run | resume | replay` alike: each
benchmark's scores with their 95% bootstrap intervals, records, failed records and wall time; the requests each
server answered for each benchmark; and the run's wall time. And the report of a run (`RunReport`, `DemoReport`):
its JSON and its text."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


@dataclass(frozen=True)
class RunReport:
    """A run of evals as `fedpool eval run | resume | replay` reports it: the scores table, then each benchmark's
    records (from before, written now, failed) and artifact."""

    run_dir: Path
    wall_time_s: float
    summaries: tuple[EvalSummary, ...]

    def as_json(self) -> dict[str, Any]:
        return {"run_dir": str(self.run_dir), "wall_time_s": self.wall_time_s,
                "benchmarks": {s.benchmark: {**s.summary, "artifact_dir": str(s.artifact_dir), "written_now": s.written}
                               for s in self.summaries}}

    def text(self) -> str:
        return "\n".join([scores_table(self.summaries, self.wall_time_s), f"Artifacts: {self.run_dir}", *(
            f"  {s.benchmark}: {s.summary['records']} records ({s.resumed} from before, {s.written} now, "
            f"{s.summary['failed']} failed); {s.artifact_dir}" for s in self.summaries)])


@dataclass(frozen=True)
class DemoReport(RunReport):
    """`fedpool demo`'s run: also the requests each server answered, the servers, and where the engines' logs are."""

    answered: dict[str, dict[str, int]]  # server id -> benchmark -> requests answered
    servers: tuple[dict[str, Any], ...]

    def as_json(self) -> dict[str, Any]:
        return {**super().as_json(), "answered": self.answered, "servers": list(self.servers)}

    def text(self) -> str:
        return "\n".join([scores_table(self.summaries, self.wall_time_s), f"Artifacts: {self.run_dir}",
                          *(f"  {s.artifact_dir}/records.jsonl, summary.json" for s in self.summaries),
                          f"  {self.run_dir}/run.json, report.json; engine logs in {self.run_dir}/logs"])
