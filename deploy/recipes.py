"""What `fedpool up` prints once its pool is up: paste-ready commands for the eval tools researchers already run,
filled in with the pool's base URL, model and state dir (docs/researchers.md has more, each run as pasted)."""

from __future__ import annotations

from pathlib import Path


def recipes(base: str, model: str, state_dir: Path | None = None, default_state_dir: Path | None = None) -> str:
    """The commands, pointed at the pool; the pool's state dir, where not `default_state_dir`, on fedpool's own
    commands (they find the registry there)."""
    default = default_state_dir.expanduser().resolve() if default_state_dir else None
    state = "" if state_dir is None or state_dir.expanduser().resolve() == default else f" --state-dir {state_dir}"
    return f"""\
Point your eval tool at {base}/v1 (model name: {model}). Give each tool its own key: the pool tells clients
apart by it (any string; no key file is needed on loopback). Say how many requests a run sends and a short
one is served to its end first: ?fedpool_requests=N on base_url, or the header X-Fedpool-Requests: N.

  lm-eval-harness:
    OPENAI_API_KEY=eval-a lm_eval --model local-completions --tasks YOUR_TASK --model_args \\
      model={model},base_url={base}/v1/completions,num_concurrent=8,tokenized_requests=False,tokenizer_backend=None
  inspect_ai:
    POOL_BASE_URL={base}/v1 POOL_API_KEY=eval-b inspect eval YOUR_TASK \\
      --model openai-api/pool/{model} --max-connections 8
    VLLM_BASE_URL={base}/v1 VLLM_API_KEY=eval-b inspect eval YOUR_TASK --model vllm/{model}
  openai SDK (Python; temperature=0: the same answer every time):
    client = openai.OpenAI(base_url="{base}/v1", api_key="eval-c")
    answer = client.completions.create(model="{model}", prompt="2+2=", max_tokens=4, temperature=0, stop=["\\n"])
    print(answer.choices[0].text)   # 4 (the bundled Gemma's answer)
  vLLM's serving benchmark:
    vllm bench serve --backend openai --base-url {base} --endpoint /v1/completions --model {model} \\
      --tokenizer LOCAL_TOKENIZER_DIR --dataset-name random --random-input-len 64 --random-output-len 32
  curl:
    curl {base}/v1/completions -H 'Content-Type: application/json' \\
      -d '{{"model": "{model}", "prompt": "Hello", "max_tokens": 8}}'
  a whole workload at once (an OpenAI batch: JSONL of requests, as vLLM's run-batch reads; the openai SDK's
  files.create and batches.create work too):
    fedpool batch submit{state} REQUESTS.jsonl --endpoint /v1/chat/completions --wait
  the pool page: {base}/   who is on the pool: fedpool pool status{state} (or pool top)
  fedpool's own evals: fedpool eval run{state} --spec SPEC.yaml --model {model} --out runs/x"""
