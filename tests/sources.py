"""Python source parsed for the tests that read the code (layering, complexity, security, pricing)."""

from __future__ import annotations

import ast
import gc


def parse_source(text: str, filename: str = "<unknown>") -> ast.Module:
    """`ast.parse` with the cycle collector paused. CPython 3.11 keeps one recursion counter for the AST
    constructor per interpreter (gh-106905): a finalizer that runs while it builds a tree — an asyncio task an
    earlier test left with its exception unretrieved is collected and logs its traceback, and 3.11's traceback
    formatting parses source — re-enters it, and the outer parse fails with "SystemError: AST constructor recursion
    depth mismatch" (seen once in CI, in test_security after test_lease_capacity on the same worker)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(text, filename=filename)
    finally:
        if enabled:
            gc.enable()
