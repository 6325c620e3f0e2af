"""The emulated engines' profiles: the figures `deploy.emulator` and `deploy.batching` time requests by, each
profile saying where its figures come from (data-sheet derivations, a fit to a real server, round numbers)."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EmulatorProfile:
    """One engine on one accelerator. Step cost: see `deploy.batching`; every time is engine seconds
    (the server's `speedup` divides them)."""

    name: str = "tiny"
    max_running: int = 8  # vLLM max_num_seqs / SGLang max_running_requests
    prefill_s_per_token: float = 0.0
    decode_s_per_token: float = 0.002  # one decode step of a batch of one
    batch_slowdown: float = 0.05  # each extra running sequence slows a step by this fraction
    default_output_tokens: int = 8  # the model's answer length when max_tokens allows it (EOS)
    protocol: str = "vllm"  # vllm | sglang: metric names, labels and extra endpoints
    attn_s_per_ctx_token: float = 0.0  # KV read per context token per step
    kv_cache_tokens: int | None = None  # KV budget; None: bounded by max_running only
    max_batched_tokens: int = 8192  # token budget of one step (chunked prefill)
    prefix_cache: bool = False
    output_spread: float = 0.0  # answers end early: length × (1 − spread × u), u ∈ [0,1) from the prompt hash
    request_overhead_s: float = 0.0  # API-server work per request outside engine steps (HTTP, tokenizing)
    # How often the server looks for a client that went away, in engine seconds of waiting for a request's output
    # (0: at once, as vLLM's API server cancels the handler). SGLang's tokenizer manager waits for each request's
    # output with a 4 s timeout and aborts the request, queued or running, when on a timeout its client has gone
    # (`_wait_one_response`); a non-streamed answer sends nothing before its end, so that is when it is noticed.
    abort_check_s: float = 0.0
    source: str = ""  # where the figures come from


# Figures for a 7.6 B-parameter dense model in bf16/fp16 (Qwen2.5-7B-class, as the 7B omni models of the
# OmniEvaluator paper's Table 7: 28 layers, 4 KV heads × 128 dims), derived from the accelerators' data sheets;
# they are derivations, not measurements, and each profile's `source` shows the arithmetic.
_WEIGHTS_GB = 15.2  # 7.6e9 params × 2 bytes
_KV_BYTES_PER_TOKEN = 57_344  # 2 (K,V) × 28 layers × 4 heads × 128 dims × 2 bytes
_FLOP_PER_TOKEN = 15.2e9  # 2 × params


SGLANG_ABORT_CHECK_S = 4.0  # SGLang's tokenizer manager: the timeout of its wait for a request's output


def _derived(name: str, *, hbm_gbs: float, bw_eff: float, tflops: float, mfu: float, mem_gb: float,
             util: float, protocol: str = "vllm", overhead: float = 1.0) -> EmulatorProfile:
    decode = _WEIGHTS_GB / (hbm_gbs * bw_eff) * overhead  # one step reads every weight once
    kv_tokens = int(((mem_gb * util) - _WEIGHTS_GB - 3.0) * 1e9 / _KV_BYTES_PER_TOKEN)  # 3 GB activations/graphs
    source = (
        f"derived: decode step {_WEIGHTS_GB} GB weights / ({hbm_gbs:.0f} GB/s HBM × {bw_eff}) × {overhead}"
        f" = {decode * 1e3:.1f} ms; prefill {_FLOP_PER_TOKEN / 1e9:.1f} GFLOP/token / ({tflops:.0f} TFLOPS × {mfu})"
        f" = {_FLOP_PER_TOKEN / (tflops * 1e12 * mfu) * 1e3:.3f} ms/token; KV {_KV_BYTES_PER_TOKEN} B/token in"
        f" {mem_gb:.0f} GB × {util} − weights − 3 GB = {kv_tokens} tokens; KV read"
        f" {_KV_BYTES_PER_TOKEN / (hbm_gbs * 1e9 * bw_eff) * 1e9:.0f} ns per context token per step"
    )
    return EmulatorProfile(
        name, max_running=256, prefill_s_per_token=_FLOP_PER_TOKEN / (tflops * 1e12 * mfu), decode_s_per_token=decode,
        batch_slowdown=0.004, default_output_tokens=32768, protocol=protocol,
        abort_check_s=SGLANG_ABORT_CHECK_S if protocol == "sglang" else 0.0,
        attn_s_per_ctx_token=_KV_BYTES_PER_TOKEN / (hbm_gbs * 1e9 * bw_eff), kv_cache_tokens=kv_tokens,
        max_batched_tokens=8192, prefix_cache=True, output_spread=0.0, source=source,
    )


PROFILES = {
    "tiny": EmulatorProfile("tiny", source="a fast toy engine for tests"),
    # No engine time at all: what a proxy in front of it adds is all there is to measure (gateway capacity).
    "instant": EmulatorProfile("instant", max_running=4096, decode_s_per_token=0.0, batch_slowdown=0.0,
                               default_output_tokens=4, source="no engine time (for measuring proxies in front)"),
    # Illustrative GPU profiles kept for the policy benchmark and tests (round numbers, not derived).
    "a100-illustrative": EmulatorProfile("a100-illustrative", max_running=32, prefill_s_per_token=0.0002,
                                         decode_s_per_token=0.012, batch_slowdown=0.02, default_output_tokens=4096,
                                         source="illustrative round numbers"),
    "sglang-a100-illustrative": EmulatorProfile(
        "sglang-a100-illustrative", max_running=32, prefill_s_per_token=0.0002, decode_s_per_token=0.011,
        batch_slowdown=0.02, default_output_tokens=4096, protocol="sglang", abort_check_s=SGLANG_ABORT_CHECK_S,
        source="illustrative round numbers"),
    "v100-illustrative": EmulatorProfile("v100-illustrative", max_running=16, prefill_s_per_token=0.0005,
                                         decode_s_per_token=0.024, batch_slowdown=0.03, default_output_tokens=4096,
                                         source="illustrative round numbers"),
    # The real vLLM 0.32.0 CPU server on this project's 2-core CI machine serving deploy/tiny_hf_model.py
    # (float32, --max-num-seqs 8), fitted to its latencies at 1-16 concurrent requests
    # (`python -m fedpool.benchmarks.emulator_fidelity --calibrate`): latency = overhead + output tokens × step,
    # step = decode × (1 + slowdown × (n − 1)), the overhead being HTTP and tokenizing.
    "cpu-vllm-tiny": EmulatorProfile(
        "cpu-vllm-tiny", max_running=8, prefill_s_per_token=0.0, decode_s_per_token=0.0015, batch_slowdown=0.04,
        default_output_tokens=512, request_overhead_s=0.003, max_batched_tokens=2048, kv_cache_tokens=1_048_576,
        prefix_cache=True,
        source="fitted to the real vLLM 0.32.0 CPU server (benchmarks/results/emulator_fidelity.md)"),
    # A100-SXM4-80GB: 2,039 GB/s HBM2e, 312 TFLOPS dense bf16 (NVIDIA A100 data sheet); vLLM's default
    # gpu_memory_utilization 0.9 and max_num_seqs 256, chunked prefill at 8192 batched tokens.
    "vllm-a100-80gb-7b": _derived("vllm-a100-80gb-7b", hbm_gbs=2039, bw_eff=0.75, tflops=312, mfu=0.5,
                                  mem_gb=80, util=0.9),
    # SGLang on the same GPU: mem_fraction_static ≈ 0.88 for 80 GB cards; slightly lower per-step overhead.
    "sglang-a100-80gb-7b": _derived("sglang-a100-80gb-7b", hbm_gbs=2039, bw_eff=0.75, tflops=312, mfu=0.5,
                                    mem_gb=80, util=0.88, protocol="sglang", overhead=0.95),
    # H100-SXM5-80GB: 3,350 GB/s HBM3, 989 TFLOPS dense bf16 (NVIDIA H100 data sheet); the same achieved
    # efficiencies as the A100 (no FP8): a derivation, not a measurement.
    "vllm-h100-80gb-7b": _derived("vllm-h100-80gb-7b", hbm_gbs=3350, bw_eff=0.75, tflops=989, mfu=0.5,
                                  mem_gb=80, util=0.9),
    "sglang-h100-80gb-7b": _derived("sglang-h100-80gb-7b", hbm_gbs=3350, bw_eff=0.75, tflops=989, mfu=0.5,
                                    mem_gb=80, util=0.88, protocol="sglang", overhead=0.95),
    # V100-SXM2-32GB: 900 GB/s HBM2, 125 TFLOPS fp16 tensor (NVIDIA V100 data sheet); no FlashAttention-2,
    # so lower achieved efficiency.
    "vllm-v100-32gb-7b": _derived("vllm-v100-32gb-7b", hbm_gbs=900, bw_eff=0.7, tflops=125, mfu=0.4,
                                  mem_gb=32, util=0.9),
}


def profile_from_json(text: str) -> EmulatorProfile:
    """A profile given in full as JSON (how the speedup benchmark passes overridden figures)."""
    raw = json.loads(text)
    if not isinstance(raw, dict):
        raise ValueError("--profile-json must be a JSON object")
    known = set(EmulatorProfile.__dataclass_fields__)
    unknown = set(raw) - known
    if unknown:
        raise ValueError(f"unknown profile fields {sorted(unknown)}; known: {sorted(known)}")
    return EmulatorProfile(**raw)
