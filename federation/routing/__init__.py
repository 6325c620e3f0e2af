"""Routing policies: where a waiting request goes.

Each policy implements the core's `Policy` interface (federation/core/policy.py); the simple ones compose a
sample of servers with room and a picker, planned routing and earliest finish plan over server kinds
(pricing, the horizon rule, waves). Pure: no I/O, an injected clock. Imports the core's public types only.
"""
