"""GPU presets and the simulator's step-time cost model.

Rationale
    The simulator answers "how many requests fit and how fast do they drain" on a given
    GPU's memory, so it needs the memory size, the share an engine keeps back (activations,
    CUDA graphs, fragmentation: vLLM's ``gpu_memory_utilization``) and a cost per step
    good enough to turn step counts into seconds and to rank allocators. Ranking is what
    the paper's figures show; absolute seconds are a convenience.

Approach
    KV memory = GPU memory x (1 - reserved share) - weight bytes.
    Step time (a roofline, documented in docs/simulator.md):

        t = overhead + max(bytes_read / hbm_bandwidth, flops / peak_flops)
        bytes_read = weight bytes + KV bytes the step's attention reads
        flops      = 2 x parameters x batched tokens

    Decode steps are memory bound (weights + KV), large prefill chunks compute bound.

Limitations
    No attention FLOPs in prefill, no kernel launch modelling beyond a fixed overhead, no
    tensor parallelism; efficiency factors are fixed constants, not fitted to a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 10**9
GiB = 1 << 30


class HardwareError(ValueError):
    """An unknown GPU preset or a model that does not fit."""


@dataclass(frozen=True)
class GPU:
    """One GPU: memory, bandwidth and peak dense bf16 throughput (vendor figures)."""

    name: str
    memory_bytes: int
    hbm_bytes_per_s: float
    peak_flops: float
    bandwidth_efficiency: float = 0.8
    flops_efficiency: float = 0.6
    step_overhead_s: float = 0.004

    def kv_budget_bytes(self, weight_bytes: int, reserved_share: float) -> int:
        """Bytes left for the KV cache: memory x (1 - reserved) - weights."""
        if not 0.0 <= reserved_share < 1.0:
            raise HardwareError(f"reserved share must be in [0, 1), got {reserved_share}")
        budget = int(self.memory_bytes * (1.0 - reserved_share)) - weight_bytes
        if budget <= 0:
            raise HardwareError(
                f"{self.name}: {self.memory_bytes / GB:.1f} GB x (1 - {reserved_share}) leaves "
                f"no room for KV after {weight_bytes / GB:.1f} GB of weights"
            )
        return budget

    def step_time_s(self, weight_bytes: int, kv_read_bytes: int, batched_tokens: int) -> float:
        """Simulated seconds of one engine step (roofline; see the module note)."""
        params = weight_bytes / 2  # bf16 weights
        memory_s = (weight_bytes + kv_read_bytes) / (
            self.hbm_bytes_per_s * self.bandwidth_efficiency
        )
        compute_s = 2.0 * params * batched_tokens / (self.peak_flops * self.flops_efficiency)
        return self.step_overhead_s + max(memory_s, compute_s)


GPUS: dict[str, GPU] = {
    "h100-80gb": GPU("H100 80 GB", 80 * GB, 3.35e12, 989e12),
    "h200-141gb": GPU("H200 141 GB", 141 * GB, 4.8e12, 989e12),
    "l4-24gb": GPU("L4 24 GB", 24 * GB, 300e9, 121e12),
}


def get_gpu(name: str) -> GPU:
    key = name.lower()
    if key not in GPUS:
        raise HardwareError(f"unknown GPU {name!r}; known: {sorted(GPUS)}")
    return GPUS[key]
