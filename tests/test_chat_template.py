"""The bundled Gemma 3 270M is served with a chat template it can answer under; any other GGUF keeps its own.

The bundled GGUF is the base model and carries no template: llama-server's fallback (ChatML) made every chat
request come back as the question echoed between `<|im_start|>` tags.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from fedpool.deploy.llamacpp import LlamaServerConfig, llama_server_process
from fedpool.deploy.models import GEMMA_ALIAS, ensure_gemma
from fedpool.deploy.process import free_port

# Questions whose answer the base model gives on its first line under the template (checked: 6 of 6 at one slot).
CAPITALS = {"France": "Paris", "Greece": "Athens", "Portugal": "Lisbon", "Ireland": "Dublin", "Austria": "Vienna",
            "Russia": "Moscow"}


@pytest.mark.llamacpp
async def test_bundled_gemma_answers_chat_requests(tmp_path: Path) -> None:
    model = await asyncio.to_thread(ensure_gemma)
    # One slot: requests run one at a time, so the greedy answers do not depend on what shares the batch.
    config = LlamaServerConfig(model_path=model, alias=GEMMA_ALIAS, port=free_port(), slots=1)
    server = llama_server_process(config, tmp_path / "llama.log")
    await server.start()
    try:
        await server.wait_healthy(config.url + "/health", deadline_s=120)
        async with aiohttp.ClientSession(base_url=config.url) as http:
            async with http.post("/apply-template", json={"messages": [
                    {"role": "user", "content": "What is the capital of France?"}]}) as resp:
                prompt = (await resp.json())["prompt"]
            assert "<|im_start|>" not in prompt
            assert prompt.endswith("What is the capital of France?\nAnswer:")

            answers = {}
            for country in CAPITALS:
                question = f"What is the capital of {country}?"
                body = {"model": GEMMA_ALIAS, "messages": [{"role": "user", "content": question}],
                        "max_tokens": 12, "temperature": 0}
                async with http.post("/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    answers[country] = (await resp.json())["choices"][0]["message"]["content"]
    finally:
        await server.stop()

    for country, answer in answers.items():
        assert "<|im_" not in answer, answer
        first_line = answer.strip().split("\n")[0]
        assert f"capital of {country}?" not in first_line, f"the question came back: {answer!r}"
    right = [c for c, answer in answers.items() if CAPITALS[c] in answer.strip().split("\n")[0]]
    assert len(right) >= 4, answers


def test_only_the_bundled_gguf_gets_a_template(tmp_path: Path) -> None:
    binary = Path("/bin/llama-server")
    own = tmp_path / "my-model.gguf"
    own.write_bytes(b"GGUF" + bytes(64))
    argv = LlamaServerConfig(model_path=own, alias="mine", port=9000).argv(binary)
    assert "--chat-template" not in argv and "--jinja" not in argv  # its embedded template is used

    bundled = ensure_gemma()
    argv = LlamaServerConfig(model_path=bundled, alias=GEMMA_ALIAS, port=9000).argv(binary)
    # --jinja before --chat-template: llama-server reads the template as Jinja source only then.
    assert argv.index("--jinja") < argv.index("--chat-template")
    assert "Question: " in argv[argv.index("--chat-template") + 1]

    # The operator's own choice in extra_args wins.
    argv = LlamaServerConfig(model_path=bundled, alias=GEMMA_ALIAS, port=9000,
                             extra_args=("--chat-template-file", "/t.jinja")).argv(binary)
    assert argv.count("--chat-template-file") == 1 and "--chat-template" not in argv
    argv = LlamaServerConfig(model_path=own, alias="mine", port=9000, chat_template="{{ messages }}").argv(binary)
    assert argv[argv.index("--chat-template") + 1] == "{{ messages }}"
