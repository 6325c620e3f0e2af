"""Imports flow one way (docs/architecture.md): checked on the source, not by hope."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROOMS = ("registry", "federation", "clients", "pipeline", "deploy", "fedpool")
# room -> rooms it may import. registry: none; federation: registry; pipeline: none (no networking);
# clients: federation + pipeline; deploy: registry; fedpool (the CLI face): everything.
ALLOWED = {
    "registry": set(),
    "federation": {"registry"},
    "pipeline": set(),
    "clients": {"federation", "pipeline"},
    "deploy": {"registry"},
    "fedpool": set(ROOMS),
}
# pipeline may run its CPU stages on Ray actors (the architecture asks for it) but speaks no HTTP itself.
NETWORK_MODULES = {"aiohttp", "requests", "httpx", "socket", "urllib3"}


def room_of(module: str) -> str:
    """`fedpool.registry.state` -> `registry`; `fedpool.cli` -> `fedpool` (the face); `aiohttp.web` -> `aiohttp`."""
    parts = module.split(".")
    if parts[0] == "fedpool" and len(parts) > 1 and parts[1] in ROOMS:
        return parts[1]
    return parts[0]


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(room_of(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(room_of(node.module))
    return names


def test_rooms_import_only_what_they_may() -> None:
    problems = []
    for room in ROOMS:
        for path in sorted((ROOT / room).rglob("*.py")):
            for name in imports_of(path) & set(ROOMS):
                if name != room and name not in ALLOWED[room]:
                    problems.append(f"{path.relative_to(ROOT)} imports {name}")
    assert problems == []


def test_pipeline_has_no_networking() -> None:
    offenders = [
        f"{p.relative_to(ROOT)}: {sorted(imports_of(p) & NETWORK_MODULES)}"
        for p in sorted((ROOT / "pipeline").rglob("*.py"))
        if imports_of(p) & NETWORK_MODULES
    ]
    assert offenders == []


def test_federation_uses_only_registry_public_names() -> None:
    offenders = []
    for path in sorted((ROOT / "federation").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fedpool.registry."):
                offenders.append(f"{path.relative_to(ROOT)}: from {node.module}")
    assert offenders == []


def test_the_checker_catches_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("from fedpool.clients import EvalRun\nimport fedpool.registry.state\n")
    assert imports_of(bad) == {"clients", "registry"}
