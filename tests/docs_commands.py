"""The fenced commands of README.md and docs/*.md, and how each is marked for the docs test (tests/test_docs.py).

A fence of commands (```bash, ```sh, ```python) carries a marker: an HTML comment on the lines just above it, which
a rendered page does not show:

    <!-- docs-test: run
         skip gpu: fedpool serve --engine vllm
         serve: fedpool gateway -->

The first line says what the fence is: `run` (its commands run against a local pool) or `skip REASON` (none of them
does, for REASON). The lines after it are directives, each naming commands by their first words (after any leading
VAR=value words; several separated by commas):

    skip REASON: PREFIX, ...   these are skipped, named with REASON (one of REASONS)
    serve: PREFIX, ...         a server: started in the background, up once it says "Ctrl-C"; stopped (SIGTERM, exit
                               0) when the next one starts or the fence ends
    pool: PREFIX, ...          the command that starts or stops the test's own pool (the test runs it once, first/last)
    exit N: PREFIX, ...        expected to exit N (default 0)
    beside: COMMAND            a server the fence needs (an operator runs it: `fedpool jobs serve`), started before it
    output below               the next fence, a plain one, is what the fence's last command prints

A fence of commands without a marker, a reason not in REASONS, or a directive that names no command of its fence is a
mistake (`problems`)."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
COMMAND_FENCES = ("bash", "sh", "shell", "python")
REASONS = {
    "hub": "needs the Hugging Face hub",
    "gpu": "needs a GPU",
    "host": "needs a second host: a Ray cluster of its own (head and nodes), or servers at other addresses",
    "network": "installs from a package index (pip, scripts/install_*.sh), or runs a tool only that installs",
    "long": "minutes of work another test runs (tests/test_cli.py: `fedpool demo`; tests/test_bench.py: `bench "
            "speedup`)",
    "self": "the test suite this test is part of",
}
FENCE = re.compile(r"^```(\w*)\s*$")
ASSIGNMENTS = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)+")
HEREDOC = re.compile(r"<<-?\s*['\"]?(\w+)['\"]?")


@dataclass
class Marker:
    what: str  # "run" or "skip"
    reason: str | None = None  # of a fence skipped whole
    skips: dict[str, str] = field(default_factory=dict)  # prefix -> reason
    serves: list[str] = field(default_factory=list)
    pools: list[str] = field(default_factory=list)
    exits: dict[str, int] = field(default_factory=dict)
    beside: list[str] = field(default_factory=list)
    output_below: bool = False
    problems: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Command:
    doc: str  # README.md, docs/researchers.md
    line: int  # where the command begins in the doc (1-based)
    section: str  # the `## ` section it is in: a reader's shell (directory, exports) starts afresh in each
    text: str  # as written (a python fence: run with python3)
    action: str  # run, serve, pool, skip
    reason: str | None = None  # why it is skipped
    exit_code: int = 0

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


@dataclass(frozen=True)
class Fence:
    doc: str
    line: int
    section: str
    commands: tuple[Command, ...]
    beside: tuple[str, ...] = ()
    shown: str | None = None  # what its last command prints, as the doc shows it (`output below`)


def bare(command: str) -> str:
    """The command without its leading VAR=value words: what a directive's prefix is matched against."""
    return ASSIGNMENTS.sub("", command.lstrip())


def split_commands(lines: list[str]) -> list[tuple[int, str]]:
    """A shell fence's commands (offset of their first line, text): continued lines (`\\`, an open quote) and
    heredocs are part of theirs; blank lines and comment lines are none."""
    commands, i = [], 0
    while i < len(lines):
        if not lines[i].strip() or lines[i].lstrip().startswith("#"):
            i += 1
            continue
        start, parts = i, [lines[i]]
        while (parts[-1].rstrip().endswith("\\") or _open_quote("\n".join(parts))) and i + 1 < len(lines):
            i += 1
            parts.append(lines[i])
        heredoc = HEREDOC.search("\n".join(parts))
        while heredoc and i + 1 < len(lines):
            i += 1
            parts.append(lines[i])
            if lines[i].strip() == heredoc.group(1):
                break
        commands.append((start, "\n".join(parts)))
        i += 1
    return commands


def _open_quote(text: str) -> bool:
    """Whether a quote opened in `text` is still open (the command goes on on the next line)."""
    try:
        shlex.split(text, comments=True)
    except ValueError:
        return True
    return False


def parse_marker(text: str) -> Marker:
    """A marker comment's meaning (its problems in `problems`)."""
    first, *rest = [line.strip() for line in text.split("docs-test:", 1)[1].strip().splitlines()]
    words = first.split()
    marker = Marker(words[0] if words else "")
    if marker.what == "skip" and len(words) == 2:
        marker.reason = words[1]
    elif words != ["run"]:
        marker.problems.append(f"the marker says {first!r}: expected `run` or `skip REASON`")
    for line in rest:
        _directive(marker, line)
    for reason in [marker.reason, *marker.skips.values()]:
        if reason is not None and reason not in REASONS:
            marker.problems.append(f"skip reason {reason!r} is not one of {', '.join(REASONS)}")
    return marker


def _directive(marker: Marker, line: str) -> None:
    if line == "output below":
        marker.output_below = True
        return
    key, sep, value = line.partition(":")
    prefixes = [p.strip() for p in value.split(",") if p.strip()]
    words = key.split()
    if not sep or not words or not prefixes:
        marker.problems.append(f"directive {line!r} is not `KEY: COMMAND, ...`")
    elif words[0] == "skip" and len(words) == 2:
        marker.skips.update(dict.fromkeys(prefixes, words[1]))
    elif words[0] == "exit" and len(words) == 2 and words[1].isdigit():
        marker.exits.update(dict.fromkeys(prefixes, int(words[1])))
    elif words == ["serve"]:
        marker.serves += prefixes
    elif words == ["pool"]:
        marker.pools += prefixes
    elif words == ["beside"]:
        marker.beside.append(value.strip())
    else:
        marker.problems.append(f"directive {line!r}: unknown (skip REASON, serve, pool, exit N, beside, output below)")


def _command(doc: str, line: int, section: str, text: str, marker: Marker, used: set[str]) -> Command:
    """One command of a marked fence, as its marker says to treat it."""
    def named(prefixes: Iterable[str]) -> str | None:
        hit = next((p for p in prefixes if re.match(re.escape(p) + r"(\s|$)", bare(text))), None)
        if hit is not None:
            used.add(hit)
        return hit

    exit_code = marker.exits[hit] if (hit := named(marker.exits)) is not None else 0
    if marker.what == "skip":
        return Command(doc, line, section, text, "skip", marker.reason)
    if (hit := named(marker.skips)) is not None:
        return Command(doc, line, section, text, "skip", marker.skips[hit])
    action = "serve" if named(marker.serves) else "pool" if named(marker.pools) else "run"
    return Command(doc, line, section, text, action, None, exit_code)


def read_doc(path: Path) -> tuple[list[Fence], list[str]]:
    """A doc's fences of commands, and its mistakes (`file:line: what`)."""
    doc = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name
    lines = path.read_text(encoding="utf-8").splitlines()
    fences, problems, section, i = [], [], "", 0
    while i < len(lines):
        if lines[i].startswith("## "):
            section = lines[i][3:].strip()
        opened = FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        if opened.group(1) in COMMAND_FENCES:
            fence, found = _fence(doc, lines, i, end, section, opened.group(1))
            fences.append(fence)
            problems += found
        i = end + 1
    return fences, problems


def _fence(doc: str, lines: list[str], start: int, end: int, section: str, lang: str) -> tuple[Fence, list[str]]:
    where = f"{doc}:{start + 1}"
    comment = _comment_above(lines, start)
    if comment is None or "docs-test:" not in comment:
        return Fence(doc, start + 1, section, ()), [f"{where}: a fence of commands without a docs-test marker"]
    marker = parse_marker(comment)
    body = lines[start + 1:end]
    if lang == "python":
        found = [(0, "python3 - <<'PYEOF'\n" + "\n".join(body) + "\nPYEOF")]
    else:
        found = split_commands(body)
    used: set[str] = set()
    commands = tuple(_command(doc, start + 2 + offset, section, text, marker, used) for offset, text in found)
    named = [*marker.skips, *marker.serves, *marker.pools, *marker.exits]
    problems = [f"{where}: {p}" for p in marker.problems]
    problems += [f"{where}: directive names {p!r}, which begins no command of the fence"
                 for p in named if p not in used]
    shown = _shown_below(lines, end) if marker.output_below else None
    if marker.output_below and shown is None:
        problems.append(f"{where}: `output below`, but no plain fence follows")
    return Fence(doc, start + 1, section, commands, tuple(marker.beside), shown), problems


def _comment_above(lines: list[str], fence: int) -> str | None:
    """The HTML comment that ends on the line just above `fence`, if one does."""
    if fence == 0 or not lines[fence - 1].rstrip().endswith("-->"):
        return None
    start = fence - 1
    while start > 0 and "<!--" not in lines[start]:
        start -= 1
    return "\n".join(lines[start:fence]).split("<!--", 1)[1].rsplit("-->", 1)[0]


def _shown_below(lines: list[str], end: int) -> str | None:
    """The body of the plain fence (no language) that follows line `end`, prose between allowed."""
    for i in range(end + 1, len(lines)):
        if FENCE.match(lines[i]):
            if lines[i].strip() != "```":
                return None
            close = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            return "\n".join(lines[i + 1:close])
    return None


def read_docs(paths: tuple[Path, ...] = DOCS) -> tuple[list[Fence], list[str]]:
    fences, problems = [], []
    for path in paths:
        found, wrong = read_doc(path)
        fences += found
        problems += wrong
    return fences, problems
