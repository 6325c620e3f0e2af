"""The docs stay true: every fenced command in README.md and docs/*.md is marked (tests/docs_commands.py), and the
commands marked runnable here run, as a new user pastes them, against a real local pool — `fedpool up --detach` with a
temporary HOME (its state dir) and port — with their exit codes and, where a doc shows one, their output checked.
A command that needs a hub, a GPU or a second host is skipped by name, never silently.

What a doc leaves to its reader is made concrete, and nothing else changes: its placeholders (SUBSTITUTIONS: the
pool's temporary ports, HEAD and GPU_NODE are this machine, qwen-7b is the pool's model), and the reader's own files
(`my_bench.yaml`, `keys.txt`, `registry.token`, `model.gguf`, ...: `workspace`), in a directory of their own per doc.
Each `## ` section starts in that directory with a fresh shell; a section's commands share one (cd, export)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from fedpool.deploy.process import free_port
from tests.docs_commands import DOCS, REASONS, ROOT, Command, Fence, read_doc, read_docs

AT_LEAST = 30  # documented commands the docs test runs (the floor)
COMMAND_TIMEOUT_S = 600.0
READY_WITHIN_S = 120.0  # a server command says "Ctrl-C" once it serves
MODEL = "gemma3-270m"
ARITH = ROOT / "pipeline" / "bundled" / "arith.yaml"
CAPITALS = ROOT / "pipeline" / "bundled" / "capitals.yaml"
LINKED = (".venv", "docs", "pipeline", "benchmarks", "scripts", "deploy")  # relative paths the docs use


def test_every_fenced_command_is_marked_and_enough_of_them_run() -> None:
    """No fence of commands without a marker, no stale directive, no reason outside the list; and the floor."""
    fences, problems = read_docs()
    assert problems == [], "\n".join(problems)
    runnable = [c for f in fences for c in f.commands if c.action in ("run", "serve")]
    assert len(runnable) >= AT_LEAST, len(runnable)


def test_the_marker_rules_catch_what_they_should(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("## A\n\n```bash\nfedpool pool status\n```\n\n<!-- docs-test: run\n     skip gpu: fedpool serve\n"
                   "     skip moon: fedpool gateway -->\n```bash\nfedpool server list \\\n    --json\nx='a\nb'\n"
                   "cat > f <<'EOF'\nfedpool serve\nEOF\n```\n\n<!-- docs-test: run\n     output below -->\n"
                   "```python\nprint(1)\n```\n\n```\n1\n```\n")
    fences, problems = read_doc(doc)
    assert [p.split(": ", 1)[1] for p in problems] == [
        "a fence of commands without a docs-test marker", "skip reason 'moon' is not one of " + ", ".join(REASONS),
        "directive names 'fedpool serve', which begins no command of the fence",
        "directive names 'fedpool gateway', which begins no command of the fence"]
    assert [c.text for c in fences[1].commands] == ["fedpool server list \\\n    --json", "x='a\nb'",
                                                    "cat > f <<'EOF'\nfedpool serve\nEOF"]
    assert fences[2].shown == "1" and fences[2].commands[0].text.startswith("python3 - <<'PYEOF'\nprint(1)")


@dataclass
class Pool:
    """The places and ports the documented commands are pointed at."""

    root: Path
    home: Path
    port: int = field(default_factory=free_port)  # `fedpool up`'s gateway
    gateway: int = field(default_factory=free_port)  # a `fedpool gateway` of its own
    jobs: int = field(default_factory=free_port)  # `fedpool jobs serve`
    engine: int = field(default_factory=free_port)  # a server an operator registers by hand (the emulator)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def shared(self) -> Path:
        """Where specs and data shared with the jobs server live: its default --root (JOBS_DIR/data)."""
        return self.home / ".fedpool" / "jobs" / "data"

    def substitutions(self, workspace: Path) -> list[tuple[str, str]]:
        """Each placeholder of the docs -> what it is here, in order (regular expressions)."""
        return [(r"--port 8080\b", f"--port {self.gateway}"), (r"\b8080\b", str(self.port)),
                (r"\b8090\b", str(self.jobs)), (r"\b(?:GPU_NODE|10\.0\.0\.5):8000\b", f"127.0.0.1:{self.engine}"),
                (r"\bHEAD\b", "127.0.0.1"), (r"\bqwen-7b\b", MODEL), ("/shared/specs/", f"{self.shared}/"),
                ("/srv/fedpool/jobs", str(workspace / "srv-jobs")), ("/shared/benchmarks", str(workspace))]


@dataclass
class Outcome:
    command: Command
    problem: str | None = None


@pytest.mark.ray
@pytest.mark.llamacpp
@pytest.mark.lmeval
def test_the_documented_commands_run_against_a_local_pool(tmp_path: Path, record_property: Callable[..., None]
                                                        ) -> None:
    fences, problems = read_docs()
    assert problems == [], "\n".join(problems)
    pool = start_place(tmp_path)
    starts = [c for f in fences for c in f.commands if c.action == "pool" and " up" in c.text]
    stops = [c for f in fences for c in f.commands if c.action == "pool" and " down" in c.text]
    outcomes: list[Outcome] = []
    readme = workspace(pool, "README")
    started = foreground(starts[0], pool, readme, Shell(readme, pool.env, tmp_path / "shell-up"))
    assert started.returncode == 0, started.stdout + started.stderr
    emulator = subprocess.Popen([sys.executable, "-m", "fedpool.deploy.emulator", "--model", MODEL, "--port",
                                 str(pool.engine)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for doc in DOCS:
            ran = [f for f in fences if f.doc == str(doc.relative_to(ROOT))]
            if any(c.action != "skip" for f in ran for c in f.commands):
                outcomes += run_doc(ran, pool, workspace(pool, doc.stem))
    finally:
        stopped = foreground(stops[0], pool, readme, Shell(readme, pool.env, tmp_path / "shell-down"))
        emulator.terminate()
        emulator.wait(30)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    report = summary(fences, outcomes)
    record_property("docs_test", report)
    print(report)
    failed = [f"{o.command.where}: {o.problem}" for o in outcomes if o.problem]
    assert not failed, "\n\n".join(failed)
    assert sum(1 for o in outcomes if o.command.action in ("run", "serve")) >= AT_LEAST


def summary(fences: list[Fence], outcomes: list[Outcome]) -> str:
    """The count the issue asks for: the commands run, and those skipped, by reason and by name."""
    ran = sum(1 for o in outcomes if o.command.action in ("run", "serve"))
    pools = sum(1 for f in fences for c in f.commands if c.action == "pool")
    skipped: dict[str, list[str]] = {}
    for command in (c for f in fences for c in f.commands if c.action == "skip"):
        first = command.text.splitlines()[0].split("  #")[0].rstrip(" \\")
        shown = first if len(first) <= 60 else first[:57] + "..."
        skipped.setdefault(command.reason or "", []).append(f"{command.where} `{shown}`")
    lines = [f"docs test: {ran} documented commands run against a local pool ({pools} more start or stop it, run "
             f"by the test itself), {sum(map(len, skipped.values()))} skipped by name:"]
    lines += [f"  {reason} ({REASONS[reason]}): {', '.join(names)}" for reason, names in skipped.items()]
    return "\n".join(lines)


def start_place(tmp_path: Path) -> Pool:
    """A HOME of its own (the pool's default state dir is in it) with the bundled model where fedpool looks for it,
    and the environment every command runs in: the venv first on PATH, the pool's port in a config file."""
    from fedpool.deploy.models import GEMMA_FILE, ensure_gemma

    pool = Pool(tmp_path, tmp_path / "home")
    models = pool.home / ".cache" / "fedpool" / "models"
    models.mkdir(parents=True)
    (models / GEMMA_FILE).symlink_to(ensure_gemma())
    config = tmp_path / "fedpool.toml"
    config.write_text(f"[up]\nport = {pool.port}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FEDPOOL_", "RAY_", "OPENAI_", "VIRTUAL_ENV"))}
    pool.env = {**env, "HOME": str(pool.home), "PATH": f"{ROOT / '.venv' / 'bin'}:{env.get('PATH', '')}",
                "FEDPOOL_CONFIG": str(config), "FEDPOOL_JOBS_URL": f"http://127.0.0.1:{pool.jobs}"}
    return pool


def workspace(pool: Pool, name: str) -> Path:
    """A directory for one doc's commands: the repository's folders the docs name, and the reader's own files."""
    place = pool.root / "docs" / name
    if place.exists():
        return place
    place.mkdir(parents=True)
    for name in LINKED:
        (place / name).symlink_to(ROOT / name)
    data = pool.shared  # the reader's data, under `fedpool jobs serve`'s default --root
    data.mkdir(parents=True, exist_ok=True)
    specs = {"my_bench.yaml": (ARITH, "arith"), "arith.yaml": (ARITH, "arith"), "other.yaml": (CAPITALS, "capitals"),
             "docvqa.yaml": (CAPITALS, "docvqa")}
    for file, (spec, benchmark) in specs.items():
        rows = (spec.parent / f"{spec.stem}.jsonl").read_text().splitlines()[:8]
        (data / f"{spec.stem}.jsonl").write_text("\n".join(rows) + "\n")
        (place / f"{spec.stem}.jsonl").write_text("\n".join(rows) + "\n")
        text = spec.read_text().replace(f"name: {spec.stem}", f"name: {benchmark}")
        for where in (place, data):
            (where / file).write_text(text.replace(f"path: {spec.stem}.jsonl", f"path: {data / spec.stem}.jsonl"))
    for file in ("arith_with_f1.yaml", "my_arith_with_f1.yaml"):
        (place / file).write_text((place / "arith.yaml").read_text().replace("[exact_match]", "[exact_match, f1]"))
    (place / "keys.txt").write_text("researcher:sk-docs-test-0123456789\n")
    (place / "model.gguf").symlink_to(pool.home / ".cache" / "fedpool" / "models" / "gemma3-270m-q4_k_m.gguf")
    token = pool.home / ".fedpool" / "up" / "registry" / "registry.token"
    if token.exists():
        shutil.copy(token, place / "registry.token")
    return place


class Shell:
    """A reader's terminal for one section of a doc: its directory and exported variables carry from command to
    command (each runs in a bash of its own that starts from them and saves them)."""

    def __init__(self, start: Path, env: dict[str, str], state: Path):
        self.state = state
        state.mkdir(parents=True, exist_ok=True)
        (state / "cwd").write_text(str(start))
        subprocess.run(["bash", "-c", f"export -p > {state / 'env'}"], env=env, check=True)

    def script(self, command: str, *, background: bool = False) -> str:
        restore = f'cd "$(cat {self.state / "cwd"})" && source {self.state / "env"}\n'
        if background:  # exec: the server is the process signalled
            return restore + ("exec env " if re.match(r"\w+=", command) else "exec ") + command
        return (restore + "{\n" + command + "\n}\nrc=$?\n"
                f"pwd > {self.state / 'cwd'}\nexport -p > {self.state / 'env'}\nexit $rc\n")


def concrete(text: str, pool: Pool, place: Path) -> str:
    """The command with the docs' placeholders made this pool's."""
    for pattern, value in pool.substitutions(place):
        text = re.sub(pattern, value, text)
    if "BATCH_ID" in text:
        text = text.replace("BATCH_ID", newest_batch(pool))
    return text.replace("JOB_ID", newest_job(pool)) if "JOB_ID" in text else text


def newest_batch(pool: Pool) -> str:
    """The batch the reader just submitted to the pool's gateway, as the CLI's default caller (`--client`)."""
    from fedpool.clients.batchclient import BatchClient

    batch_id: str = BatchClient(f"http://127.0.0.1:{pool.port}").every()[0]["id"]
    return batch_id


def newest_job(pool: Pool) -> str:
    """The job the reader just submitted, once it has ended (so what `jobs show` says and whether `jobs cancel` may
    cancel it do not depend on timing)."""
    from fedpool.clients.jobs import JobsClient

    token = (pool.home / ".fedpool" / "jobs" / "jobs.token").read_text().strip()
    jobs = JobsClient(f"http://127.0.0.1:{pool.jobs}", token)
    job_id: str = jobs.list()[0]["id"]
    jobs.wait(job_id, timeout_s=300)
    return job_id


def foreground(command: Command, pool: Pool, place: Path, shell: Shell) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", shell.script(concrete(command.text, pool, place))], env=pool.env,
                          capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)


@dataclass
class Server:
    command: Command | str
    proc: subprocess.Popen[str]
    log: Path


def start_server(command: Command | str, pool: Pool, place: Path, shell: Shell, log: Path) -> Server | str:
    """A server command started in the background, once it serves; what went wrong instead."""
    text = concrete(command.text if isinstance(command, Command) else command, pool, place)
    with log.open("w") as out:
        proc = subprocess.Popen(["bash", "-c", shell.script(text, background=True)], env=pool.env, stdout=out,
                                stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + READY_WITHIN_S
    while "Ctrl-C" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            return f"did not come up (exit {proc.returncode}):\n{log.read_text()[-3000:]}"
        time.sleep(0.2)
    return Server(command, proc, log)


def stop_server(server: Server) -> str | None:
    """SIGTERM, as Ctrl-C: it ends by itself with exit 0, or what went wrong."""
    server.proc.send_signal(signal.SIGTERM)
    try:
        code = server.proc.wait(60)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait()
        return f"did not stop within 60 s of SIGTERM:\n{server.log.read_text()[-3000:]}"
    return None if code == 0 else f"exit {code} after SIGTERM:\n{server.log.read_text()[-3000:]}"


def run_doc(fences: list[Fence], pool: Pool, place: Path) -> list[Outcome]:
    """Every fence of one doc, in order; a shell per `## ` section."""
    if fences[0].doc == "docs/quickstart.md":  # its commands read a run of `fedpool demo`: runs/RUN
        made = subprocess.run(["fedpool", "eval", "run", "--spec", "arith.yaml", "--model", MODEL, "--out",
                               "runs/RUN", "--quiet"], cwd=place, env=pool.env, capture_output=True, text=True,
                              timeout=COMMAND_TIMEOUT_S)
        assert made.returncode == 0, made.stderr
    outcomes: list[Outcome] = []
    shells: dict[str, Shell] = {}
    for fence in fences:
        if fence.section not in shells:
            shells[fence.section] = Shell(place, pool.env, place.parent / f".shell-{place.name}-{fence.line}")
        outcomes += run_fence(fence, pool, place, shells[fence.section])
    return outcomes


def run_fence(fence: Fence, pool: Pool, place: Path, shell: Shell) -> list[Outcome]:
    outcomes: list[Outcome] = []
    logs = place.parent / f".logs-{place.name}"
    logs.mkdir(exist_ok=True)
    beside = [start_server(b, pool, place, shell, logs / f"beside-{fence.line}.log") for b in fence.beside]
    serving: list[Server] = [b for b in beside if isinstance(b, Server)]
    for failed in (b for b in beside if isinstance(b, str)):
        outcomes.append(Outcome(fence.commands[0], f"the server the fence needs {failed}"))
    try:
        for command in fence.commands:
            outcomes.append(run_one(command, fence, pool, place, shell, serving, logs))
    finally:
        for server in serving:
            problem = stop_server(server)
            if problem and isinstance(server.command, Command):
                outcomes.append(Outcome(server.command, problem))
    return outcomes


def run_one(command: Command, fence: Fence, pool: Pool, place: Path, shell: Shell, serving: list[Server],
            logs: Path) -> Outcome:
    if command.action in ("skip", "pool"):
        return Outcome(command)
    if command.action == "serve":
        for server in [s for s in serving if isinstance(s.command, Command)]:  # one at a time: they share ports
            serving.remove(server)
            if problem := stop_server(server):
                return Outcome(server.command if isinstance(server.command, Command) else command, problem)
        started = start_server(command, pool, place, shell, logs / f"serve-{command.line}.log")
        if isinstance(started, str):
            return Outcome(command, started)
        serving.append(started)
        return Outcome(command)
    done = foreground(command, pool, place, shell)
    said = f"\n--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}"
    if done.returncode != command.exit_code:
        return Outcome(command, f"exit {done.returncode}, the docs expect {command.exit_code}{said}")
    if fence.shown is not None and command is fence.commands[-1] and done.stdout.strip() != fence.shown.strip():
        return Outcome(command, f"printed something else than the doc shows ({fence.shown!r}){said}")
    return Outcome(command)

