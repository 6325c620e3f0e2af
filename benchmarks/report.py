"""Writing benchmark reports: command, machine, date, the numbers, and one closing `result:` line."""

from __future__ import annotations

import os
import platform
import shlex
import sys
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = ""
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        mem_gib = f", {pages / 2**30:.0f} GiB RAM"
    except (ValueError, OSError):
        pass
    system = f"{platform.system()} {platform.release()}, Python {platform.python_version()}"
    return f"{cpu}, {os.cpu_count()} cores{mem_gib}, {system}"


def code_version() -> str:
    """The commit the report ran on (with `+changes` when the tree had uncommitted changes outside
    `benchmarks/results/`: a benchmark's own charts, written before its report, are not a change to the code), or
    `unknown`."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)benchmarks/results"], cwd=root,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def compile_bytecode() -> str:
    """Write the bytecode of every fedpool module (each room, through the package's links to it), as installing a
    package does, and say so for the report. The processes a benchmark starts then import fedpool as an installed one
    would, also where the environment forbids writing bytecode (PYTHONDONTWRITEBYTECODE, which this machine's sets):
    there each process would compile every module it imports from source, ~0.25 CPU-s more per start on 2 cores."""
    import compileall

    package = Path(__file__).resolve().parent.parent
    rooms = [package, *sorted({p.resolve() for p in package.iterdir() if p.is_symlink() and p.is_dir()})]
    failed = [str(room) for room in rooms if not compileall.compile_dir(room, quiet=2, workers=1)]
    if failed:
        raise RuntimeError(f"cannot compile fedpool's bytecode in {', '.join(failed)}")
    forbidden = " (this environment sets PYTHONDONTWRITEBYTECODE: without it each would compile them)" if (
        os.environ.get("PYTHONDONTWRITEBYTECODE")) else ""
    return ("Bytecode: fedpool's modules compiled once before the arms, as installing it does, so that every process "
            f"started imports them compiled{forbidden}.")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def result_line(values: Mapping[str, object]) -> str:
    return "result: " + " ".join(f"{k}={v}" for k, v in values.items())


def write_report(
    name: str, title: str, body: str, result: Mapping[str, object], *, results_dir: Path = RESULTS_DIR
) -> Path:
    """Write benchmarks/results/NAME.md; the last line is the machine-readable `result:` line."""
    results_dir.mkdir(parents=True, exist_ok=True)
    command = "python -m fedpool.benchmarks." + Path(sys.argv[0]).stem + (
        " " + shlex.join(sys.argv[1:]) if sys.argv[1:] else ""
    )
    text = (
        f"# {title}\n\n"
        f"- command: `{command}`\n"
        f"- machine: {machine_description()}\n"
        f"- code: {code_version()}\n"
        f"- date: {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}\n\n"
        f"{body.rstrip()}\n\n"
        f"{result_line(result)}\n"
    )
    path = results_dir / f"{name}.md"
    path.write_text(text, encoding="utf-8")
    return path
