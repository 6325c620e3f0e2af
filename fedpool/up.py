"""`fedpool up`: a local pool that stays up for the eval tools researchers already run, and `fedpool down`.

One process brings up local Ray (started on loopback, or an existing cluster joined), the registry, N local
servers (llama.cpp with the bundled Gemma by default, vLLM's CPU build, or the emulator), the OpenAI-compatible
gateway and the pool page; prints the base URL and paste-ready commands; and on Ctrl-C / SIGTERM stops
everything it started. `--detach` runs that process in the background (its pid in STATE_DIR/up.pid, its log
in STATE_DIR/up.log); `fedpool down` stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from fedpool.deploy.localpool import LocalPoolSpec

if TYPE_CHECKING:
    import psutil

PID_FILE = "up.pid"
READY_FILE = "up.json"
LOG_FILE = "up.log"


class PoolAlreadyUp(RuntimeError):
    """A `fedpool up` of this state dir is running."""


@dataclass(frozen=True, slots=True)
class UpOptions:
    servers: LocalPoolSpec = field(default_factory=LocalPoolSpec)
    state_dir: Path = Path("~/.fedpool/up")
    host: str = "127.0.0.1"
    port: int = 8080
    policy: str = "capacity_weighted"
    address: str | None = None  # join this Ray cluster instead of starting one


def recipes(base: str, model: str) -> str:
    """Paste-ready commands for the tools researchers run, pointed at the pool (docs/researchers.md has more)."""
    return f"""\
Point your eval tool at {base}/v1 (model name: {model}). Give each tool its own key: the pool tells clients
apart by it (any string; no key file is needed on loopback).

  lm-eval-harness:
    OPENAI_API_KEY=eval-a lm_eval --model local-completions --tasks YOUR_TASK --model_args \\
      model={model},base_url={base}/v1/completions,num_concurrent=8,tokenized_requests=False,tokenizer_backend=None
  inspect_ai:
    POOL_BASE_URL={base}/v1 POOL_API_KEY=eval-b inspect eval YOUR_TASK \\
      --model openai-api/pool/{model} --max-connections 8
    VLLM_BASE_URL={base}/v1 VLLM_API_KEY=eval-b inspect eval YOUR_TASK --model vllm/{model}
  openai SDK (Python):
    client = openai.OpenAI(base_url="{base}/v1", api_key="eval-c")
    client.completions.create(model="{model}", prompt="2+2=", max_tokens=4)
  vLLM's serving benchmark:
    vllm bench serve --backend openai --base-url {base} --endpoint /v1/completions --model {model} \\
      --tokenizer LOCAL_TOKENIZER_DIR --dataset-name random --random-input-len 64 --random-output-len 32
  curl:
    curl {base}/v1/completions -H 'Content-Type: application/json' \\
      -d '{{"model": "{model}", "prompt": "Hello", "max_tokens": 8}}'
  the pool page: {base}/
  fedpool's own evals: fedpool eval run --spec SPEC.yaml --model {model} --out runs/x"""


def running_pid(state_dir: Path) -> int | None:
    """The pid of a `fedpool up` still running from this state dir, if any."""
    try:
        pid = int((state_dir / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return pid
    return pid


def run_up(options: UpOptions, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Bring the pool up in this process and keep it up until SIGINT or SIGTERM; 0 after a clean stop."""
    import ray

    from fedpool.deploy.localpool import init_loopback_ray
    from fedpool.pipeline.ownership import private_dir

    state = private_dir(options.state_dir.expanduser().resolve())
    other = running_pid(state)
    if other is not None and other != os.getpid():
        raise PoolAlreadyUp(f"a pool is already up from {state} (pid {other}); `fedpool down --state-dir {state}` "
                            "stops it")
    (state / PID_FILE).write_text(f"{os.getpid()}\n")
    try:
        how = init_loopback_ray(options.address)
        print(f"[fedpool up] Ray: {how}", file=err, flush=True)
        try:
            return asyncio.run(_up(options, state, out, err))
        finally:
            ray.shutdown()
    finally:
        for name in (PID_FILE, READY_FILE):
            with contextlib.suppress(FileNotFoundError):
                (state / name).unlink()


async def _up(options: UpOptions, state: Path, out: TextIO, err: TextIO) -> int:

    from fedpool.deploy.localpool import local_servers
    from fedpool.federation import DispatchConfig, PoolConnection
    from fedpool.federation.gateway import Gateway, serving
    from fedpool.registry import RegistryClient
    from fedpool.server import build_app

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    spec = options.servers
    registry = await RegistryClient.start(state / "registry", probe_interval_s=2.0)
    info = await registry.ping()
    print(f"[fedpool up] registry: namespace fedpool, state dir {info['state_dir']}", file=err, flush=True)
    try:
        print(f"[fedpool up] starting {spec.count} {spec.engine} server(s)", file=err, flush=True)
        async with local_servers(registry, spec, state / "logs",
                                 on_progress=lambda line: print(f"[fedpool up] {line}", file=err, flush=True)):
            config = DispatchConfig(no_server_timeout_s=10.0, client_order="shortest_first")
            async with PoolConnection(registry, policy=options.policy, config=config) as pool:
                await pool.refresh()
                gateway = Gateway(pool.dispatcher, lambda: pool.snapshot)
                app = build_app(gateway, pool.dispatcher, lambda: pool.snapshot)
                async with serving(app, options.host, options.port) as base:
                    model = spec.served_model()
                    import ray

                    ready = {"url": base, "model": model, "pid": os.getpid(), "servers": spec.count,
                             "engine": spec.engine, "ray_address": ray.get_runtime_context().gcs_address,
                             "state_dir": str(state), "started_at": time.time()}
                    (state / READY_FILE).write_text(json.dumps(ready, indent=2) + "\n")
                    print(f"fedpool pool up: {spec.count} {spec.engine} server(s) serving {model!r} at {base}/v1 "
                          f"(Ray {ready['ray_address']})\n", file=out, flush=True)
                    print(recipes(base, model), file=out, flush=True)
                    print("\nCtrl-C (or `fedpool down`) stops everything this started.", file=out, flush=True)
                    await stop.wait()
                    print("[fedpool up] stopping", file=err, flush=True)
    finally:
        await registry.terminate()
    return 0


def detach(argv: list[str], options: UpOptions, out: TextIO = sys.stdout, timeout_s: float = 900.0) -> int:
    """Start `fedpool up` (these arguments, without --detach) in the background and wait until it is up."""
    from fedpool.pipeline.ownership import private_dir

    state = private_dir(options.state_dir.expanduser().resolve())
    if running_pid(state) is not None:
        raise PoolAlreadyUp(f"a pool is already up from {state}; `fedpool down --state-dir {state}` stops it")
    with contextlib.suppress(FileNotFoundError):
        (state / READY_FILE).unlink()
    log_path = state / LOG_FILE
    args = [a for a in argv if a != "--detach"]
    with log_path.open("ab") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "fedpool.cli", *args], stdout=log_file,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"`fedpool up` exited with {proc.returncode} before the pool was up; {log_path}:\n"
                               f"{tail}")
        if (state / READY_FILE).exists():
            ready = json.loads((state / READY_FILE).read_text())
            print(f"fedpool pool up in the background (pid {proc.pid}, log {log_path}): {ready['servers']} "
                  f"{ready['engine']} server(s) serving {ready['model']!r} at {ready['url']}/v1\n", file=out)
            print(recipes(ready["url"], ready["model"]), file=out)
            print(f"\n`fedpool down --state-dir {state}` stops it.", file=out, flush=True)
            return 0
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"the pool was not up after {timeout_s:g} s; see {log_path}")


def down(state_dir: Path, out: TextIO = sys.stdout, timeout_s: float = 60.0) -> int:
    """Stop the `fedpool up` of this state dir and every process of its pool (SIGTERM to it; SIGKILL to whatever
    is left after `timeout_s`). Returns once all of them are gone: 0 when they stopped by themselves."""
    state = state_dir.expanduser().resolve()
    pid = running_pid(state)
    if pid is None:
        print(f"no pool is up from {state}", file=out)
        return 0
    pool = PoolProcesses(pid)
    pool.scan()
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pool.scan()  # processes started since (Ray's workers and agents come and go while it shuts down)
        if not pool.alive():
            print(f"stopped the pool of {state} (pid {pid})", file=out)
            return 0
        time.sleep(DOWN_POLL_S)
    left = pool.kill_all()
    print(f"the pool of {state} (pid {pid}) did not stop in {timeout_s:g} s; killed {len(left)} process(es) of it",
          file=out)
    return 1


DOWN_POLL_S = 0.1
KILL_WAIT_S = 10.0  # after SIGKILL, how long `down` waits for the processes to be gone


class PoolProcesses:
    """Every process of the pool a `fedpool up` runs: itself, every process of its session (the detached `up` leads
    a session of its own, so Ray's processes and workers and the servers stay in it when their parent has died
    and they are re-parented, or when they start after `down` began), and its descendants seen so far (an `up`
    run in the foreground shares its terminal's session, which is not the pool's). Waiting only for the
    children seen when `down` began let `down` return while the `up` process itself, a Ray process re-parented
    mid-shutdown or a worker started after that snapshot was still running."""

    def __init__(self, pid: int):
        import psutil

        self.pid = pid
        self.seen: dict[int, psutil.Process] = {}
        self.own_session = _session_of(pid) == pid
        with contextlib.suppress(psutil.NoSuchProcess):
            self.seen[pid] = psutil.Process(pid)

    def scan(self) -> None:
        """Add the processes of the pool running now."""
        import psutil

        leader = self.seen.get(self.pid)
        if leader is None:
            return
        found: list[psutil.Process] = []
        with contextlib.suppress(psutil.Error):
            if leader.is_running():  # (its pid not yet taken by another process)
                found.extend(leader.children(recursive=True))
        if self.own_session:
            for proc in psutil.process_iter():
                if proc.pid not in self.seen and _session_of(proc.pid) == self.pid:
                    found.append(proc)
        for proc in found:
            self.seen.setdefault(proc.pid, proc)

    def alive(self) -> list[psutil.Process]:
        """The pool's processes still running (a zombie has exited: it only waits for its parent to reap it)."""
        import psutil

        running = []
        for proc in self.seen.values():
            try:
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    running.append(proc)
            except psutil.NoSuchProcess:
                pass
        return running

    def kill_all(self) -> list[psutil.Process]:
        """SIGKILL every process of the pool still running and wait until they are gone; those that were."""
        import psutil

        self.scan()
        left = self.alive()
        for proc in left:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        deadline = time.monotonic() + KILL_WAIT_S
        while self.alive() and time.monotonic() < deadline:
            time.sleep(DOWN_POLL_S)
        return left


def _session_of(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:  # gone (or not ours to ask about)
        return None

