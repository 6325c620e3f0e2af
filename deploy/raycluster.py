"""Joining a running Ray cluster from a command (`fedpool gateway`, `fedpool eval run`, `fedpool server ...`):
checked for reachability first, so a wrong address is named at once instead of waiting on Ray's retries."""

from __future__ import annotations

import os
import socket

import ray

from fedpool.deploy.localpool import _RAY_SETTINGS, is_loopback_address, loopback_ray_mode


def join_ray(address: str) -> str | None:
    """Join the Ray cluster at `address` (`auto`: RAY_ADDRESS, else the cluster started last on this machine)
    and say which one and how it was found: with two clusters on a host, `auto` finds the one started last. None
    when this process has joined one already. ConnectionError, saying what to do, when none answers there."""
    if ray.is_initialized():
        return None
    if address != "auto" and not _tcp_reachable(address):
        raise ConnectionError(f"cannot reach a Ray cluster at {address!r}; start one with `ray start --head` "
                              "or pass --address HOST:PORT of a running head node")
    how = ("--address" if address != "auto" else
           "RAY_ADDRESS" if os.environ.get("RAY_ADDRESS") else "the cluster started last on this machine")
    if is_loopback_address(address):  # a loopback-only cluster (`fedpool up`): join it on loopback
        loopback_ray_mode()
    try:
        ray.init(address=address, **_RAY_SETTINGS)
    except ConnectionError as exc:
        raise ConnectionError(f"cannot reach a Ray cluster at {address!r} ({exc}); start one with `ray start --head`"
                              ) from None
    return f"Ray cluster {ray.get_runtime_context().gcs_address} (found by {how})"


def _tcp_reachable(address: str, timeout_s: float = 2.0) -> bool:
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False
