"""fedpool's Ray-based registry of inference servers. Public names only; other rooms import these.

The names that need Ray (the actor, its Ray client) are imported on first use: a process that reaches the
registry over its HTTP API (`RegistryHttpClient`, an eval process that starts no CPU actors) never imports Ray,
whose import and cluster join cost each such process CPU time."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from fedpool.registry.adapters import EngineAdapter, MetricsParseError, adapter_for
from fedpool.registry.demand import (
    HOLDER_KINDS,
    ClientDemand,
    DemandReport,
    HolderInfo,
    HolderKind,
    ModelDemand,
    Served,
    holder_id,
    holder_info,
    loading_report,
)
from fedpool.registry.errors import AuthError, RegistrationError, RegistryError, UnknownServerError
from fedpool.registry.holders import (
    ClientProgress,
    FinishedClient,
    HoldersSource,
    HolderView,
    KindSlots,
    PoolHolders,
    ServerSlots,
    ServerUse,
)
from fedpool.registry.leases import Lease, LeaseBroker, LeaseServer, LeaseService
from fedpool.registry.placement import CHEAPEST_TIE, HORIZON_MARGIN, fluid_horizon, usable_kinds
from fedpool.registry.records import Engine, ServerRecord
from fedpool.registry.snapshot import LoadSample, PoolSnapshot, ProbeResult, ServerEntry, ServerStatus
from fedpool.registry.watcher import PoolRegistry, SnapshotWatcher
from fedpool.registry.weights import ACCELERATOR_ROOFLINE, ACCELERATOR_SPEED, accelerator_roofline, prior_weight

if TYPE_CHECKING:
    from fedpool.registry.actor import NAMESPACE, REGISTRY_NAME, RegistryConfig
    from fedpool.registry.client import RegistryClient

_RAY_NAMES = {"NAMESPACE": "actor", "REGISTRY_NAME": "actor", "RegistryConfig": "actor", "RegistryClient": "client"}


def __getattr__(name: str) -> Any:
    module = _RAY_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = [
    "ACCELERATOR_ROOFLINE",
    "ACCELERATOR_SPEED",
    "CHEAPEST_TIE",
    "HOLDER_KINDS",
    "HORIZON_MARGIN",
    "NAMESPACE",
    "REGISTRY_NAME",
    "AuthError",
    "ClientDemand",
    "ClientProgress",
    "DemandReport",
    "Engine",
    "EngineAdapter",
    "FinishedClient",
    "HolderInfo",
    "HolderKind",
    "HolderView",
    "HoldersSource",
    "KindSlots",
    "Lease",
    "LeaseBroker",
    "LeaseServer",
    "LeaseService",
    "LoadSample",
    "MetricsParseError",
    "ModelDemand",
    "PoolHolders",
    "PoolRegistry",
    "PoolSnapshot",
    "ProbeResult",
    "RegistrationError",
    "RegistryClient",
    "RegistryConfig",
    "RegistryError",
    "Served",
    "ServerEntry",
    "ServerRecord",
    "ServerSlots",
    "ServerStatus",
    "ServerUse",
    "SnapshotWatcher",
    "UnknownServerError",
    "accelerator_roofline",
    "adapter_for",
    "fluid_horizon",
    "holder_id",
    "holder_info",
    "loading_report",
    "prior_weight",
    "usable_kinds",
]
