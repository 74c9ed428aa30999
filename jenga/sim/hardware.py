"""GPU presets and the simulator's step-time cost model.

Rationale
    The simulator answers "how many requests fit and how fast do they drain" on a given
    GPU's memory, so it needs the memory the device really reports, what an engine keeps
    back, and a cost per step good enough to turn step counts into seconds and to rank
    allocators. Ranking is what the paper's figures show; absolute seconds are a
    convenience.

Approach
    Memory is what ``torch.cuda.mem_get_info`` / ``nvidia-smi`` report for the device
    (an "80 GB" H100 has 81,559 MiB). Like vLLM's memory profiling, the KV budget is::

        KV bytes = memory x gpu_memory_utilization - weight bytes - reserved bytes

    where ``reserved`` is a *fixed* amount (activations at the profiled batch, CUDA
    graphs, non-torch allocations) and ``1 - gpu_memory_utilization`` is the share the
    engine leaves to others (vLLM's default utilization 0.9).

    Step time (a roofline, documented in docs/simulator.md)::

        t = overhead + max(bytes_read / hbm_bandwidth, flops / peak_flops)
        bytes_read = weight bytes + KV bytes the step's attention reads
        flops      = 2 x parameters x batched tokens + attention FLOPs

    Attention FLOPs are 4 x (query heads x head dim) per (query, attended key) pair per
    layer (QK^T and PV), summed by the engine over each step's tokens
    (`jenga.sim.models.ComputeShape`). Decode steps are memory bound (weights + KV),
    long prefill chunks compute bound, and a 100K-token prefill costs about twice the
    parameter FLOPs alone.

Limitations
    No kernel launch modelling beyond a fixed overhead, no tensor parallelism; efficiency
    factors are fixed constants, not fitted to a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 10**9
GiB = 1 << 30
MiB = 1 << 20


class HardwareError(ValueError):
    """An unknown GPU preset or a model that does not fit."""


@dataclass(frozen=True)
class GPU:
    """One GPU: device memory, bandwidth and peak dense bf16 throughput (vendor figures)."""

    name: str
    memory_bytes: int
    hbm_bytes_per_s: float
    peak_flops: float
    bandwidth_efficiency: float = 0.8
    flops_efficiency: float = 0.6
    step_overhead_s: float = 0.004

    def kv_budget_bytes(
        self, weight_bytes: int, reserved_share: float, reserved_bytes: int = 0
    ) -> int:
        """Bytes left for the KV cache: memory x (1 - reserved share) - weights - reserved."""
        if not 0.0 <= reserved_share < 1.0:
            raise HardwareError(f"reserved share must be in [0, 1), got {reserved_share}")
        if reserved_bytes < 0:
            raise HardwareError(f"reserved bytes must be >= 0, got {reserved_bytes}")
        budget = int(self.memory_bytes * (1.0 - reserved_share)) - weight_bytes - reserved_bytes
        if budget <= 0:
            raise HardwareError(
                f"{self.name}: {self.memory_bytes / GiB:.1f} GiB x (1 - {reserved_share}) leaves "
                f"no room for KV after {weight_bytes / GiB:.1f} GiB of weights and "
                f"{reserved_bytes / GiB:.1f} GiB reserved"
            )
        return budget

    def step_time_s(
        self,
        weight_bytes: int,
        kv_read_bytes: int,
        batched_tokens: int,
        attention_flops: float = 0.0,
    ) -> float:
        """Simulated seconds of one engine step (roofline; see the module note)."""
        params = weight_bytes / 2  # bf16 weights
        memory_s = (weight_bytes + kv_read_bytes) / (
            self.hbm_bytes_per_s * self.bandwidth_efficiency
        )
        flops = 2.0 * params * batched_tokens + attention_flops
        compute_s = flops / (self.peak_flops * self.flops_efficiency)
        return self.step_overhead_s + max(memory_s, compute_s)


# Device memory as the driver reports it (nvidia-smi "Total"): H100 SXM 80 GB 81,559 MiB,
# H200 141 GB 143,771 MiB, L4 24 GB 23,034 MiB; A100 40 GB as torch reports it, 40,536 MiB.
# Bandwidth and dense bf16 peak from the vendors' data sheets.
GPUS: dict[str, GPU] = {
    "h100-80gb": GPU("H100 80 GB", 81_559 * MiB, 3.35e12, 989e12),
    "h200-141gb": GPU("H200 141 GB", 143_771 * MiB, 4.8e12, 989e12),
    "l4-24gb": GPU("L4 24 GB", 23_034 * MiB, 300e9, 121e12),
    "a100-40gb": GPU("A100 40 GB", 40_536 * MiB, 1.555e12, 312e12),
}


def get_gpu(name: str) -> GPU:
    key = name.lower()
    if key not in GPUS:
        raise HardwareError(f"unknown GPU {name!r}; known: {sorted(GPUS)}")
    return GPUS[key]
