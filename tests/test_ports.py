"""Ports handed to child servers cannot be taken by a process binding port 0 before the child binds them."""

from __future__ import annotations

import socket

from fedpool.deploy.process import _ephemeral_low, free_port


def test_free_ports_come_from_below_the_ephemeral_range_and_above_rays_worker_ports() -> None:
    low = _ephemeral_low()
    picked = [free_port() for _ in range(50)]
    assert all(20000 <= port < low for port in picked), picked
    assert len(set(picked)) > 40  # drawn at random, not walked from one start
    # A process binding port 0 (as Ray's gRPC servers do) gets a port from the ephemeral range instead.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        assert sock.getsockname()[1] >= low


def test_a_port_in_use_is_never_handed_out() -> None:
    held = []
    try:
        for _ in range(20):
            port = free_port()
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", port))  # raises if free_port handed out a port in use
            sock.listen()
            held.append(sock)
    finally:
        for sock in held:
            sock.close()
