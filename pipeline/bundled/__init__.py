"""Small deterministic benchmarks that ship with fedpool (see README.md here for how they are made)."""

from __future__ import annotations

from pathlib import Path

BUNDLED_DIR = Path(__file__).parent
BUNDLED_NAMES = ("arith", "capitals", "capitals_mc")


def bundled_spec_paths() -> list[Path]:
    return [BUNDLED_DIR / f"{name}.yaml" for name in BUNDLED_NAMES]
