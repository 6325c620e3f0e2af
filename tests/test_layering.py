"""Imports flow one way (docs/architecture.md): checked on the source of every room, not by hope."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

from tests.sources import parse_source

ROOT = Path(__file__).resolve().parent.parent
# Every folder of the repository that holds code: the rooms of the one installed package `fedpool` (each a
# subpackage: `fedpool.registry` lives in registry/), the CLI face (`fedpool/`) and the tests.
ROOMS = ("registry", "federation", "pipeline", "clients", "deploy", "benchmarks", "fedpool", "tests")
PRODUCT = {"registry", "federation", "pipeline", "clients", "deploy"}
# room -> the rooms it may import. Anything not listed is forbidden.
ALLOWED: dict[str, set[str]] = {
    "registry": set(),  # the registry: ServerRecord, adapters, prober, snapshots
    "federation": {"registry"},  # routing over the registry's snapshots (its public names only, below)
    "pipeline": set(),  # records, specs, loaders, metrics, artifacts: no networking, no routing
    "clients": {"federation", "pipeline"},  # eval runs and the jobs service that runs them
    "deploy": {"registry"},  # launchers register what they start
    "benchmarks": PRODUCT,  # measures the product; nothing in the product imports it
    "fedpool": PRODUCT,  # the face: parses, composes, prints; imports no benchmark code
    "tests": PRODUCT | {"benchmarks", "fedpool"},
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
    tree = parse_source(path.read_text(encoding="utf-8"), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(room_of(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(room_of(node.module))
    return names


def violations(root: Path) -> list[str]:
    """Every import of a room by a room the table does not allow, under `root`."""
    problems = []
    for room in ROOMS:
        for path in sorted((root / room).rglob("*.py")):
            for name in sorted(imports_of(path) & set(ROOMS)):
                if name != room and name not in ALLOWED[room]:
                    problems.append(f"{path.relative_to(root)} imports {name}")
    return problems


# federation/'s own rooms, each a folder of at most MAX_SUBROOM_FILES files: the dispatch core, the routing policies
# on it, the gateway and HTTP side on both. A sub-room imports only those listed (and itself).
FEDERATION_ROOMS: dict[str, set[str]] = {
    "core": set(),  # the dispatcher and its books, the policy interface: no policy, no HTTP
    "routing": {"core"},  # the policies: the core's public types
    "gateway": {"core", "routing"},  # handlers, transport, leases, the pool connection: on top
}
MAX_SUBROOM_FILES = 12


def federation_room_of(module: str) -> str | None:
    """`fedpool.federation.core.ledger` -> `core`; `fedpool.federation` (the package's public names) -> None."""
    parts = module.split(".")
    if parts[:2] == ["fedpool", "federation"] and len(parts) > 2:
        return parts[2]
    return None


def federation_violations(root: Path) -> list[str]:
    """Every import between federation/'s sub-rooms that FEDERATION_ROOMS does not allow, and any file of
    federation/ outside a sub-room (its `__init__.py` aside)."""
    problems = []
    for path in sorted((root / "federation").rglob("*.py")):
        rel = path.relative_to(root / "federation")
        if len(rel.parts) == 1:
            if rel.name != "__init__.py":
                problems.append(f"federation/{rel} is in no sub-room")
            continue
        room = rel.parts[0]
        if room not in FEDERATION_ROOMS:
            problems.append(f"federation/{rel} is in an unknown sub-room")
            continue
        tree = parse_source(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                       else [])
            for module in modules:
                other = federation_room_of(module)
                if module == "fedpool.federation" or (other is not None and other != room
                                                      and other not in FEDERATION_ROOMS[room]):
                    problems.append(f"federation/{rel} imports {module}")
    return problems


def test_federation_sub_rooms_import_one_way_and_stay_small() -> None:
    assert federation_violations(ROOT) == []
    for room in FEDERATION_ROOMS:
        files = sorted(p.name for p in (ROOT / "federation" / room).glob("*.py"))
        assert len(files) <= MAX_SUBROOM_FILES, (room, files)
        assert ast.get_docstring(parse_source((ROOT / "federation" / room / "__init__.py").read_text())), room


@pytest.mark.parametrize(("room", "forbidden"), [(r, o) for r in FEDERATION_ROOMS for o in FEDERATION_ROOMS
                                                  if o != r and o not in FEDERATION_ROOMS[r]])
def test_the_checker_catches_every_forbidden_edge_between_federation_rooms(tmp_path: Path, room: str,
                                                                           forbidden: str) -> None:
    for r in FEDERATION_ROOMS:
        (tmp_path / "federation" / r).mkdir(parents=True)
    (tmp_path / "federation" / room / "added.py").write_text(f"from fedpool.federation.{forbidden}.x import name\n")
    assert federation_violations(tmp_path) == [f"federation/{room}/added.py imports fedpool.federation.{forbidden}.x"]


def test_every_room_is_in_the_table_and_every_code_folder_is_a_room() -> None:
    assert set(ALLOWED) == set(ROOMS)
    folders = {p.parent.relative_to(ROOT).parts[0] for p in ROOT.glob("*/**/*.py")
               if p.parent.relative_to(ROOT).parts[0] not in (".venv", "build", "scripts")}
    assert folders <= set(ROOMS), f"code outside the rooms: {sorted(folders - set(ROOMS))}"


def test_rooms_import_only_what_they_may() -> None:
    assert violations(ROOT) == []


def test_nothing_in_the_product_or_the_face_imports_benchmarks() -> None:
    offenders = [f"{p.relative_to(ROOT)}" for room in (*PRODUCT, "fedpool") for p in (ROOT / room).rglob("*.py")
                 if "benchmarks" in imports_of(p)]
    assert offenders == []


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
        tree = parse_source(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fedpool.registry."):
                offenders.append(f"{path.relative_to(ROOT)}: from {node.module}")
    assert offenders == []


FORBIDDEN = [(room, other) for room, other in itertools.product(ROOMS, ROOMS)
             if other != room and other not in ALLOWED[room]]


@pytest.mark.parametrize(("room", "forbidden"), FORBIDDEN)
def test_the_checker_catches_every_forbidden_edge_of_the_table(tmp_path: Path, room: str, forbidden: str) -> None:
    """A copy of the tree with one import the table forbids added (both spellings): the checker names it."""
    for r in ROOMS:
        (tmp_path / r).mkdir()
    target = "fedpool" if forbidden == "fedpool" else f"fedpool.{forbidden}"
    (tmp_path / room / "added.py").write_text(f"from {target}.something import name\nimport {target}\n")
    (tmp_path / room / "fine.py").write_text("import json\n" + "".join(
        f"import fedpool.{ok}\n" for ok in ALLOWED[room] if ok != "fedpool"))
    assert violations(tmp_path) == [f"{room}/added.py imports {forbidden}"]
