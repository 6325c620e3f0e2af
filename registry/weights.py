"""Prior weights for heterogeneous accelerators; the dispatcher corrects them with observed throughput."""

from __future__ import annotations

from registry.records import ServerRecord

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
