"""Command lines for every engine `fedpool serve` can launch, and accelerator detection.

Flags, checked against each engine's documentation: vLLM serves metrics at /metrics by default;
SGLang needs `--enable-metrics`; llama.cpp's server needs `--metrics`, `-np N` slots and `-cb`.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from fedpool.deploy.llamacpp import LlamaServerConfig, llama_server_binary
from fedpool.registry import Engine


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """What an operator asks `fedpool serve` for."""

    engine: str  # vllm | sglang | llamacpp | emulated
    model: str  # served model name (what clients ask for)
    port: int
    host: str = "127.0.0.1"
    model_path: str | None = None  # weights (HF dir, hub id on GPU nodes, GGUF for llama.cpp)
    capacity: int | None = None  # max concurrent sequences
    gpus: int = 0
    threads: int = 1  # llama.cpp CPU threads
    python: str = sys.executable  # the interpreter that has the engine installed (its own venv is fine)
    profile: str = "tiny"  # emulated
    speedup: float = 1.0  # emulated
    extra_args: tuple[str, ...] = field(default_factory=tuple)


def engine_argv(spec: EngineSpec) -> list[str]:
    """The child process's command line."""
    if spec.engine == "vllm":
        argv = [spec.python, "-m", "vllm.entrypoints.openai.api_server", "--model", spec.model_path or spec.model,
                "--served-model-name", spec.model, "--host", spec.host, "--port", str(spec.port)]
        if spec.capacity:
            argv += ["--max-num-seqs", str(spec.capacity)]
        if spec.gpus > 1:
            argv += ["--tensor-parallel-size", str(spec.gpus)]
        return argv + list(spec.extra_args)
    if spec.engine == "sglang":
        argv = [spec.python, "-m", "sglang.launch_server", "--model-path", spec.model_path or spec.model,
                "--served-model-name", spec.model, "--host", spec.host, "--port", str(spec.port), "--enable-metrics"]
        if spec.capacity:
            argv += ["--max-running-requests", str(spec.capacity)]
        if spec.gpus > 1:
            argv += ["--tp-size", str(spec.gpus)]
        return argv + list(spec.extra_args)
    if spec.engine == "llamacpp":
        if not spec.model_path:
            raise ValueError("--model-path (a GGUF file) is required for llamacpp")
        config = LlamaServerConfig(model_path=Path(spec.model_path), alias=spec.model, port=spec.port, host=spec.host,
                                   slots=spec.capacity or 4, threads=spec.threads, extra_args=spec.extra_args)
        return config.argv(llama_server_binary())
    if spec.engine == "emulated":
        return [spec.python, "-m", "fedpool.deploy.emulator", "--model", spec.model, "--host", spec.host, "--port",
                str(spec.port), "--profile", spec.profile, "--speedup", str(spec.speedup), *spec.extra_args]
    raise ValueError(f"unknown engine {spec.engine!r}; use vllm, sglang, llamacpp or emulated")


def registry_engine(engine: str, profile: str = "tiny") -> Engine:
    """The registry adapter an engine is probed with (an emulator speaks its profile's protocol)."""
    if engine != "emulated":
        return Engine(engine)
    from fedpool.deploy.emulator import PROFILES

    if profile not in PROFILES:
        raise ValueError(f"unknown emulator profile {profile!r}; known: {', '.join(sorted(PROFILES))}")
    return Engine(PROFILES[profile].protocol)


_GPU_NAMES = (("H200", "H200"), ("H100", "H100"), ("A100", "A100"), ("V100", "V100"), ("L40S", "L40S"),
              ("A10G", "A10G"), ("L4", "L4"), ("T4", "T4"))


def detect_accelerator() -> tuple[str, int]:
    """(accelerator, GPU count) from nvidia-smi; ('cpu', 0) when there is none."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "cpu", 0
    try:
        out = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return "cpu", 0
    names = [line.strip() for line in out.splitlines() if line.strip()]
    if not names:
        return "cpu", 0
    return gpu_family(names[0]), len(names)


def gpu_family(name: str) -> str:
    """'NVIDIA A100-SXM4-80GB' -> 'A100'; unknown names are kept as given."""
    upper = name.upper()
    for needle, family in _GPU_NAMES:
        if needle in upper:
            return family
    return name.strip()
