"""Prior weights for heterogeneous accelerators; the dispatcher corrects them with observed throughput."""

from __future__ import annotations

from fedpool.registry.records import ServerRecord

# Relative decode throughput of one device for the same model, V100 = 1.0. Rounded from published
# figures: A100 ≈ 2× V100 (HBM bandwidth 1.9–2.0 TB/s vs 0.9 TB/s, memory-bound decode), H100 SXM
# ≈ 3.3 TB/s, H200 ≈ 4.8 TB/s. Unknown accelerators get 1.0 and learn their real share.
ACCELERATOR_SPEED: dict[str, float] = {
    "H200": 4.5,
    "H100": 3.5,
    "A100": 2.0,
    "L40S": 1.0,
    "A10G": 0.7,
    "V100": 1.0,
    "L4": 0.35,
    "T4": 0.35,
    "cpu": 0.05,
}


def prior_weight(record: ServerRecord) -> float:
    """Expected relative throughput: accelerator speed × GPUs (tensor parallel shares one model copy)."""
    speed = ACCELERATOR_SPEED.get(record.accelerator, 1.0)
    return speed * max(1, record.gpu_count)


# Data-sheet peaks per device: dense fp16/bf16 tensor TFLOPS (prefill is compute-bound) and HBM bandwidth in
# TB/s (a decode step reads the weights once). Used by the planner to price a request's prefill against its
# decode on each server; only ratios between servers matter. Unknown accelerators scale V100's by their
# ACCELERATOR_SPEED.
ACCELERATOR_ROOFLINE: dict[str, tuple[float, float]] = {
    "H200": (989.0, 4.8),
    "H100": (989.0, 3.35),
    "A100": (312.0, 2.039),
    "L40S": (362.0, 0.864),
    "A10G": (125.0, 0.6),
    "V100": (125.0, 0.9),
    "L4": (121.0, 0.3),
    "T4": (65.0, 0.32),
    "cpu": (2.0, 0.1),
}


def accelerator_roofline(accelerator: str) -> tuple[float, float]:
    """(TFLOPS, HBM TB/s) of one device of this kind."""
    known = ACCELERATOR_ROOFLINE.get(accelerator)
    if known is not None:
        return known
    tflops, tbs = ACCELERATOR_ROOFLINE["V100"]
    speed = ACCELERATOR_SPEED.get(accelerator, 1.0)
    return tflops * speed, tbs * speed
