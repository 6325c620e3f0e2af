"""`fedpool up` as a researcher runs it: a local pool of two real llama.cpp servers kept up in the background,
the openai SDK and lm-eval pointed at it, then `fedpool down` — and no process of it left behind."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import openai
import psutil
import pytest

from fedpool.deploy.process import free_port

pytestmark = pytest.mark.llamacpp
ROOT = Path(__file__).resolve().parent.parent
ANSWER_WITHIN_S = 5.0  # a client or operator command against a running pool (they used to hang 40 s and more)
WITHIN_S = 15.0  # the bound for a command that needs more than the registry (a run, a jobs server)
STOPS_WITHIN_S = 2.0  # SIGTERM to a command that serves
CTX = 256  # `fedpool up --ctx-per-slot`: the bundled six-shot arith prompt (~60 tokens) fits, thirty times it not
LM_EVAL_TASK = """\
task: fedpool_up_check
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{a}}}} + {{{{b}}}} ="
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""


def fedpool(*args: str, timeout: float = 900, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fedpool.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def running(proc: psutil.Process) -> bool:
    """Running and not a zombie (an exited process its parent has not reaped yet)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def session_of(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


@pytest.mark.lmeval
def test_up_serves_tools_and_down_leaves_nothing(tmp_path: Path) -> None:
    state = tmp_path / "up"
    port = free_port()
    started = fedpool("up", "--servers", "2", "--port", str(port), "--state-dir", str(state), "--detach")
    assert started.returncode == 0, started.stderr + started.stdout
    assert f"http://127.0.0.1:{port}/v1" in started.stdout and "lm_eval --model local-completions" in started.stdout
    ready = json.loads((state / "up.json").read_text())
    tree = [psutil.Process(ready["pid"]), *psutil.Process(ready["pid"]).children(recursive=True)]
    assert session_of(ready["pid"]) == ready["pid"]  # the detached `up` leads a session: its pool is in it
    names = {p.name() for p in tree}
    assert "llama-server" in names and any("raylet" in n for n in names), names
    assert ready["ray_address"].startswith("127.0.0.1:")  # Ray on loopback only
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-up-test-0123456789")
        models = [m.id for m in client.models.list().data]
        assert models == [ready["model"]]
        answer = client.completions.create(model=ready["model"], prompt="2 + 2 =", max_tokens=4, temperature=0)
        assert answer.choices[0].text is not None and answer.usage is not None
        again = fedpool("up", "--servers", "1", "--port", str(free_port()), "--state-dir", str(state))
        assert again.returncode == 5 and "already up" in again.stderr  # one pool per state dir
        # Another command joins the loopback-only cluster at the address `up` wrote (Ray used to rewrite
        # 127.0.0.1 to the machine's outside address, where nothing listens, and the command hung).
        listed = fedpool("server", "list", "--json", "--address", ready["ray_address"], "--state-dir",
                         str(state / "registry"), "--quiet", timeout=60)
        assert listed.returncode == 0, listed.stderr
        assert len(json.loads(listed.stdout)["servers"]) == 2

        data = tmp_path / "sums.jsonl"
        data.write_text("".join(json.dumps({"a": i, "b": i + 1, "answer": str(2 * i + 1)}) + "\n" for i in range(8)))
        tasks = tmp_path / "tasks"
        tasks.mkdir()
        (tasks / "fedpool_up_check.yaml").write_text(LM_EVAL_TASK.format(data=data))
        lm_eval = subprocess.run(
            [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--tasks", "fedpool_up_check",
             "--include_path", str(tasks), "--model_args",
             f"model={ready['model']},base_url=http://127.0.0.1:{port}/v1/completions,num_concurrent=4,"
             "tokenized_requests=False,tokenizer_backend=None", "--output_path", str(tmp_path / "lm-eval-out")],
            capture_output=True, text=True, timeout=600,
            env={**os.environ, "OPENAI_API_KEY": "sk-lm-eval-abc", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
        assert lm_eval.returncode == 0, lm_eval.stderr[-3000:]
        assert "exact_match" in lm_eval.stdout
        # fedpool's own eval, as the printed recipe says (the pool's state dir), reaches the registry over its API
        # (no Ray driver in the eval process).
        assert f"fedpool eval run --state-dir {state} --spec" in started.stdout
        ours = fedpool("eval", "run", "--state-dir", str(state), "--spec", str(ROOT / "pipeline" / "bundled" /
                       "arith.yaml"), "--model", ready["model"], "--limit", "4", "--out", str(tmp_path / "ours"),
                       timeout=120)
        assert ours.returncode == 0, ours.stderr
        assert "fedpool: registry API http://127.0.0.1:" in ours.stderr, ours.stderr
    finally:
        stopped = fedpool("down", "--state-dir", str(state), timeout=120)
    assert stopped.returncode == 0 and "stopped" in stopped.stdout, stopped.stdout + stopped.stderr
    alive = [p for p in tree if running(p)]
    assert not alive, [(p.pid, p.name()) for p in alive]
    # Nor any process that joined the pool later (a Ray worker started after `up` was ready, or re-parented):
    # the detached `up` leads its own session, and every process of the pool is in it.
    stragglers = [p for p in psutil.process_iter() if session_of(p.pid) == ready["pid"] and running(p)]
    assert not stragglers, [(p.pid, p.name()) for p in stragglers]
    assert not (state / "up.pid").exists() and not (state / "up.json").exists()


def test_commands_find_a_fedpool_up_by_its_state_dir_alone(tmp_path: Path) -> None:
    """`fedpool pool status` and `fedpool server list` reach a `fedpool up` pool given only its state dir, and given
    nothing when it is the default one (here under a temporary HOME): over its registry's HTTP API, not by Ray's
    guess of an address (the machine's outside address, where a loopback-only cluster does not listen)."""
    from fedpool.deploy.models import ensure_gemma

    home = tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home), "RAY_ADDRESS": ""}
    state = home / ".fedpool" / "up"  # the default state dir of `fedpool up` under this HOME
    started = fedpool("up", "--servers", "1", "--slots", "1", "--ctx-per-slot", str(CTX), "--port", str(free_port()),
                      "--model-path", str(ensure_gemma()), "--detach", env=env)
    assert started.returncode == 0, started.stderr + started.stdout
    try:
        model = json.loads((state / "up.json").read_text())["model"]
        for where in (["--state-dir", str(state)], []):
            status = fedpool("pool", "status", *where, timeout=ANSWER_WITHIN_S, env=env)
            assert status.returncode == 0, status.stderr
            assert status.stdout.startswith("1 server(s):") and f"model {model}: 1 server(s)" in status.stdout
            listed = fedpool("server", "list", *where, timeout=ANSWER_WITHIN_S, env=env)
            assert listed.returncode == 0, listed.stderr
            header, row = listed.stdout.splitlines()
            assert header.split()[0] == "ID" and row.split()[:4] == ["llamacpp-0", "llamacpp", "cpu", model]
            assert all("fedpool: registry API http://127.0.0.1:" in r.stderr for r in (status, listed))
        assert f"Ctrl-C (or `fedpool down --state-dir {state}`)" in (state / "up.log").read_text()
        check_the_printed_sdk_recipe_answers_as_it_says(started.stdout)
        check_runs_and_jobs_serve_beside(state, model, tmp_path, env)
        check_a_prompt_over_the_context_is_refused_for_good(state, model, tmp_path, env)
    finally:
        stopped = fedpool("down", timeout=120, env=env)
    assert stopped.returncode == 0 and "stopped" in stopped.stdout, stopped.stdout + stopped.stderr


def check_runs_and_jobs_serve_beside(state: Path, model: str, tmp_path: Path, env: dict[str, str]) -> None:
    """`eval run` with the pool's state dir; the hint for a run directory already used carries that flag; `eval
    resume RUN_DIR`, as the hints and docs word it, finds the pool the run recorded; `jobs serve --port P`, as the
    README gives it, serves within 15 s and SIGTERM ends it within 2 s."""
    out = tmp_path / "run"
    spec = str(ROOT / "pipeline" / "bundled" / "arith.yaml")
    ran = fedpool("eval", "run", "--state-dir", str(state), "--spec", spec, "--model", model, "--limit", "2",
                  "--out", str(out), timeout=120, env=env)
    assert ran.returncode == 0, ran.stderr
    again = fedpool("eval", "run", "--spec", spec, "--model", model, "--out", str(out), timeout=WITHIN_S, env=env)
    assert again.returncode == 2 and f"`fedpool eval resume --state-dir {state} {out}`" in again.stderr, again.stderr
    resumed = fedpool("eval", "resume", str(out), timeout=WITHIN_S, env=env)
    assert resumed.returncode == 0, resumed.stderr
    assert "arith: 2 records (2 from before, 0 now, 0 failed)" in resumed.stdout, resumed.stdout
    port = free_port()
    jobs = subprocess.Popen([sys.executable, "-m", "fedpool.cli", "jobs", "serve", "--port", str(port)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
    try:
        assert jobs.stdout is not None
        ready, _, _ = select.select([jobs.stdout], [], [], WITHIN_S)
        first = jobs.stdout.readline() if ready else ""  # (ended, exit 3: an empty line)
        assert first.startswith(f"fedpool gateway on http://127.0.0.1:{port}/v1"), first + jobs.communicate()[1]
        jobs.send_signal(signal.SIGTERM)
        jobs.communicate(timeout=STOPS_WITHIN_S)
        assert jobs.returncode == 0
    finally:
        if jobs.poll() is None:
            jobs.kill()
            jobs.communicate()


def check_a_prompt_over_the_context_is_refused_for_good(state: Path, model: str, tmp_path: Path,
                                                        env: dict[str, str]) -> None:
    """`--ctx-per-slot` reaches llama-server (-c is it × slots); a prompt over it is refused (HTTP 400) and not
    retried, its record says resume will not help, and fedpool does not offer `eval resume` for it."""
    ready = json.loads((state / "up.json").read_text())
    servers = [p for p in psutil.Process(ready["pid"]).children(recursive=True) if p.name() == "llama-server"]
    assert servers and all(p.cmdline()[p.cmdline().index("-c") + 1] == str(CTX) for p in servers)
    arith = ROOT / "pipeline" / "bundled" / "arith.yaml"
    text = arith.read_text()
    shots = text.split('template: "')[1].split("{a}")[0]
    long = tmp_path / "long.yaml"
    long.write_text(text.replace("name: arith", "name: long").replace("path: arith.jsonl", f"path: "
                                 f"{arith.parent / 'arith.jsonl'}").replace(shots, shots * 30))
    out = tmp_path / "long-run"
    ran = fedpool("eval", "run", "--state-dir", str(state), "--spec", str(long), "--model", model, "--limit", "2",
                  "--out", str(out), timeout=120, env=env)
    assert ran.returncode == 4, ran.stderr
    assert "2 record(s) refused as they are" in ran.stderr and "resume will not help" in ran.stderr, ran.stderr
    assert "eval resume" not in ran.stderr, ran.stderr
    records = [json.loads(line) for line in (out / "long" / "records.jsonl").read_text().splitlines()]
    assert [r["provenance"]["error_kind"] for r in records] == ["request_error", "request_error"]
    assert all(r["provenance"]["attempts"] == 1 and "resume will not help" in r["provenance"]["error"]
               and "context" in r["provenance"]["error"] for r in records), records[0]["provenance"]


def check_the_printed_sdk_recipe_answers_as_it_says(printed: str) -> None:
    """The openai SDK recipe `fedpool up` prints, pasted as it is, prints the answer its comment promises, and the
    same answer every time (temperature=0; without it llama.cpp sampled four answers in four runs)."""
    lines = printed.split("openai SDK (Python")[1].split("vLLM's serving benchmark")[0].splitlines()[1:]
    code = "import openai\n" + "\n".join(line.strip() for line in lines if line.strip())
    promised = code.rsplit("# ", 1)[1].split(" (")[0]
    answers = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
               for _ in range(3)}
    assert answers == {promised + "\n"}, (answers, code)
