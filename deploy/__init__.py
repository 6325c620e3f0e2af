"""Launchers: start engines, wait until healthy, register with the registry, heartbeat, deregister."""

from fedpool.deploy.launcher import LeaseSettings, ServerLauncher
from fedpool.deploy.llamacpp import (
    LlamaServerConfig,
    LlamaServerNotInstalled,
    llama_server_binary,
    llama_server_process,
)
from fedpool.deploy.models import GEMMA_ALIAS, ensure_gemma
from fedpool.deploy.process import EngineProcess, EngineStartError, free_port, log_tail

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
