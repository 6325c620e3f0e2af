"""The product stays readable: no function over MAX_FUNCTION_LINES lines or cyclomatic complexity MAX_COMPLEXITY
(ruff's C901, the same rule `make lint` runs), no file over MAX_FILE_LINES lines, module docstrings of at most
MAX_DOCSTRING_LINES lines (the why lives in docs/architecture.md), and the CLI face within MAX_FACE_LINES lines.
The product is every room but tests/ and benchmarks/, and the face (fedpool/*.py). A bound here is a promise
(STYLE.md 13): reshape the change, never the bound."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.sources import parse_source

ROOT = Path(__file__).resolve().parent.parent
PRODUCT_ROOMS = ("federation", "registry", "clients", "pipeline", "deploy")
MAX_FUNCTION_LINES = 60
MAX_COMPLEXITY = 15
MAX_FILE_LINES = 500
MAX_DOCSTRING_LINES = 15
MAX_FACE_LINES = 1800  # the CLI face (fedpool/*.py) parses, composes and prints; logic lives in the rooms


def product_files(root: Path = ROOT) -> list[Path]:
    files = [p for room in PRODUCT_ROOMS for p in sorted((root / room).rglob("*.py"))]
    return files + sorted(p for p in (root / "fedpool").glob("*.py") if not p.is_symlink())


def long_functions(path: Path, root: Path = ROOT) -> list[str]:
    tree = parse_source(path.read_text(encoding="utf-8"))
    return [f"{path.relative_to(root)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno is not None and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


def test_the_checker_sees_every_room() -> None:
    files = product_files()
    assert {p.relative_to(ROOT).parts[0] for p in files} == {*PRODUCT_ROOMS, "fedpool"}
    assert len(files) > 100


def test_no_product_function_is_longer_than_60_lines() -> None:
    assert [f for p in product_files() for f in long_functions(p)] == []


def test_no_product_file_is_longer_than_500_lines() -> None:
    sizes = {str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines()) for p in product_files()}
    assert {f: n for f, n in sizes.items() if n > MAX_FILE_LINES} == {}


def test_the_face_stays_thin() -> None:
    face = [p for p in (ROOT / "fedpool").glob("*.py") if not p.is_symlink()]
    assert sum(len(p.read_text(encoding="utf-8").splitlines()) for p in face) <= MAX_FACE_LINES


def test_module_docstrings_stay_short() -> None:
    long = {}
    for path in product_files():
        doc = ast.get_docstring(parse_source(path.read_text(encoding="utf-8")), clean=False)
        if doc is not None and len(doc.strip().splitlines()) > MAX_DOCSTRING_LINES:
            long[str(path.relative_to(ROOT))] = len(doc.strip().splitlines())
    assert long == {}


def test_no_product_function_is_more_complex_than_15() -> None:
    found = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--select", "C901", "--output-format", "json",
         "--config", f"lint.mccabe.max-complexity={MAX_COMPLEXITY}", *map(str, product_files())],
        capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert found.returncode in (0, 1), found.stderr
    assert [f"{d['filename']}:{d['location']['row']} {d['message']}" for d in json.loads(found.stdout)] == []


@pytest.mark.parametrize(("source", "problem"), [
    ("def f():\n" + "    x = 1\n" * 61, "long"),
    ("def f(x):\n" + "".join(f"    if x == {i}:\n        return {i}\n" for i in range(16)), "complex"),
])
def test_the_checkers_catch_what_they_look_for(tmp_path: Path, source: str, problem: str) -> None:
    path = tmp_path / "room.py"
    path.write_text(source)
    if problem == "long":
        assert long_functions(path, tmp_path) == ["room.py:1 f (62 lines)"]
    else:
        found = subprocess.run(
            [sys.executable, "-m", "ruff", "check", "--no-cache", "--isolated", "--select", "C901", "--output-format",
             "json", "--config", f"lint.mccabe.max-complexity={MAX_COMPLEXITY}", str(path)],
            capture_output=True, text=True, timeout=60)
        assert [d["code"] for d in json.loads(found.stdout)] == ["C901"]
