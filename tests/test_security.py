"""Security properties checked on the code and the CLI: no pickle, eval or unsafe YAML of anything a client
or server sends; every listener binds 127.0.0.1 unless told otherwise; mutations need a token compared
in constant time. (The token checks of each API are exercised in test_registry_actor, test_gateway and
test_jobs; secrets never reaching artifacts or logs in test_local_pool, test_jobs and test_pipeline.)"""

from __future__ import annotations

import ast
from pathlib import Path

from pydantic import BaseModel

from fedpool.cli import build_parser
from tests.sources import parse_source

ROOT = Path(__file__).resolve().parent.parent
ROOMS = ("fedpool", "registry", "federation", "clients", "pipeline", "deploy")
# The only unpickling: the registry client reading blobs the registry actor pickled itself (fedpool's own
# code inside the same Ray cluster, whose every call is pickled by Ray anyway).
PICKLE_ALLOWED = {"registry/client.py"}


def sources() -> dict[str, ast.AST]:
    out: dict[str, ast.AST] = {}
    for room in ROOMS:
        for path in sorted((ROOT / room).rglob("*.py")):
            out[str(path.relative_to(ROOT))] = parse_source(path.read_text(encoding="utf-8"))
    return out


def calls(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name):
                names.append(func.id)
            elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                names.append(f"{func.value.id}.{func.attr}")
    return names


def test_nothing_received_is_unpickled_evaluated_or_loaded_as_unsafe_yaml() -> None:
    found: dict[str, set[str]] = {}
    for path, tree in sources().items():
        for name in calls(tree):
            if name in ("eval", "exec", "pickle.loads", "pickle.load", "marshal.loads", "yaml.load",
                        "yaml.unsafe_load", "yaml.full_load"):
                found.setdefault(name, set()).add(path)
    assert "eval" not in found and "exec" not in found, found
    assert not any(k.startswith("yaml.") for k in found), found  # yaml.safe_load only
    assert found.get("pickle.loads", set()) <= PICKLE_ALLOWED and "pickle.load" not in found, found


def test_tokens_are_compared_in_constant_time() -> None:
    compare_sites = {path for path, tree in sources().items() if "hmac.compare_digest" in calls(tree)}
    # registry token and the prober's credential; gateway keys and the jobs token (one bearer helper)
    assert {"registry/auth.py", "registry/actor.py", "federation/gateway/auth.py"} <= compare_sites
    for path, tree in sources().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and any(isinstance(op, ast.Eq | ast.NotEq) for op in node.ops):
                text = ast.unparse(node)
                assert not ("token" in text.lower() and ("given" in text or "header" in text)), (path, text)


def subparser(*names: str) -> type[BaseModel]:
    return build_parser().options[" ".join(names)]  # the command's options model


def default_of(parser: type[BaseModel], dest: str) -> object:
    return parser.model_fields[dest].default


def test_every_listener_binds_loopback_by_default() -> None:
    for names, dest in ((("gateway",), "host"), (("jobs", "serve"), "host"), (("registry", "start"), "metrics_host"),
                        (("registry", "start"), "api_host"), (("serve",), "host")):
        assert default_of(subparser(*names), dest) == "127.0.0.1", names
    from fedpool.deploy.emulator import EmulatedServer
    from fedpool.registry.actor import RegistryConfig

    assert EmulatedServer(model="m")._host == "127.0.0.1"
    config = RegistryConfig(state_dir="/x", token_sha256="0" * 64)
    assert config.metrics_host == "127.0.0.1" and config.api_host == "127.0.0.1"


def test_engine_children_never_see_fedpool_credentials_and_show_config_masks_env_secrets() -> None:
    from fedpool.config import mask
    from fedpool.deploy.process import child_environment

    env = child_environment({"HF_TOKEN": "hf_secret_value"}, environ={
        "PATH": "/bin", "FEDPOOL_REGISTRY_TOKEN": "reg-token-0123456789", "FEDPOOL_JOBS_TOKEN": "jobs-0123456789abc",
        "RAY_AUTH_TOKEN": "ray-0123456789abcdef"})
    assert env == {"PATH": "/bin", "HF_TOKEN": "hf_secret_value"}
    assert mask("env", ["HF_TOKEN=hf_abc", "VLLM_CPU_KVCACHE_SPACE=1"]) == ["HF_TOKEN=***", "VLLM_CPU_KVCACHE_SPACE=1"]
