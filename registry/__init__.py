"""fedpool's Ray-based registry of inference servers. Public names only; other rooms import these."""

from registry.actor import NAMESPACE, REGISTRY_NAME, RegistryConfig
from registry.adapters import EngineAdapter, MetricsParseError, adapter_for
from registry.client import RegistryClient, SnapshotWatcher
from registry.errors import AuthError, RegistrationError, RegistryError, UnknownServerError
from registry.records import Engine, ServerRecord
from registry.snapshot import LoadSample, PoolSnapshot, ProbeResult, ServerEntry, ServerStatus
from registry.weights import ACCELERATOR_ROOFLINE, ACCELERATOR_SPEED, accelerator_roofline, prior_weight

__all__ = [
    "ACCELERATOR_ROOFLINE",
    "ACCELERATOR_SPEED",
    "NAMESPACE",
    "REGISTRY_NAME",
    "AuthError",
    "Engine",
    "EngineAdapter",
    "LoadSample",
    "MetricsParseError",
    "PoolSnapshot",
    "ProbeResult",
    "RegistrationError",
    "RegistryClient",
    "RegistryConfig",
    "RegistryError",
    "ServerEntry",
    "ServerRecord",
    "ServerStatus",
    "SnapshotWatcher",
    "UnknownServerError",
    "accelerator_roofline",
    "adapter_for",
    "prior_weight",
]
