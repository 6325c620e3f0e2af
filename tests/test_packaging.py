"""What `pip install fedpool` puts into site-packages: one import package, `fedpool`, with the rooms as its
subpackages, so no other `pipeline` or `benchmarks` can collide with ours; and the core dependencies
(SciPy among them: planned routing's linear programs run in every install, not only the bench extra)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROOMS = ("registry", "federation", "clients", "pipeline", "deploy", "benchmarks")


def test_the_wheel_holds_one_top_level_package(tmp_path: Path) -> None:
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = tmp_path.glob("fedpool-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"fedpool"}, top
    for room in ROOMS:
        assert f"fedpool/{room}/__init__.py" in names, room
    assert "fedpool/pipeline/bundled/arith.jsonl" in names and "fedpool/static/pool.html" in names


def test_scipy_is_a_core_dependency() -> None:
    requirements = metadata.requires("fedpool") or []
    core = [r for r in requirements if "extra ==" not in r]
    assert any(r.startswith("scipy") for r in core), core
