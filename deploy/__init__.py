"""Launchers: start engines, wait until healthy, register with the registry, heartbeat, deregister.

The launcher (it registers through Ray) is imported on first use: a command that only needs this package's
errors or helpers (an eval process reaching the registry over HTTP) does not import Ray for them."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from fedpool.deploy.llamacpp import (
    LlamaServerConfig,
    LlamaServerNotInstalled,
    llama_server_binary,
    llama_server_process,
)
from fedpool.deploy.models import GEMMA_ALIAS, ensure_gemma
from fedpool.deploy.process import EngineProcess, EngineStartError, free_port, log_tail

if TYPE_CHECKING:
    from fedpool.deploy.launcher import LeaseSettings, ServerLauncher


def __getattr__(name: str) -> Any:
    if name in ("LeaseSettings", "ServerLauncher"):
        return getattr(importlib.import_module("fedpool.deploy.launcher"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "GEMMA_ALIAS",
    "EngineProcess",
    "EngineStartError",
    "LeaseSettings",
    "LlamaServerConfig",
    "LlamaServerNotInstalled",
    "ServerLauncher",
    "ensure_gemma",
    "free_port",
    "llama_server_binary",
    "llama_server_process",
    "log_tail",
]
