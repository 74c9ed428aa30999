"""Where a Jenga row's prefix hits go: per-group hits, allocation steps, evictions, pages.

Rationale
    A hit rate says how much was reused, not why the rest was not. A Jenga hit needs every
    group to serve the prefix (full attention: every block before it; Mamba: the state at
    its end), so a low hit rate is one group missing, and a miss is either a rule (the
    state was never kept) or an eviction (it was kept, then evicted to make room). This
    module replays a scenario under the Jenga rows and reports, per row, the hit each
    group alone could have served, the core's allocation-step and eviction counters, and
    the mean occupancy of each group's large pages.

Approach
    Each admission first asks, per group, the longest prefix that group alone could
    serve (the core's lookup and the group policy's valid-prefix mask, exactly as the
    allocator's own match does for all groups together), then admits as the simulator
    does. Every engine step samples `JengaAllocator.usage` (mapped pages, live, cached
    and free blocks per group). ``python -m jenga.sim.diagnose --scenario mamba-chat``
    prints one table; ``--kv-gib`` and ``--allocators`` override the scenario's.

Limitations
    Reads two private parts of the allocator (building an unregistered request record
    and the core's lookup) to score groups one by one; nothing is changed by it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from jenga.allocator import JengaAllocator, Usage
from jenga.sim.engine import Engine
from jenga.sim.hardware import get_gpu
from jenga.sim.jenga_adapter import JengaCoreAllocator
from jenga.sim.protocol import AllocatorSnapshot, RequestState, SimError
from jenga.sim.scenarios import JENGA_NAMES, Scenario, build_trace, get_scenario, make_allocator

COUNTERS = ("alloc.step.2", "alloc.step.3", "alloc.step.4", "alloc.step.5", "pages.evicted",
            "blocks.evicted")  # fmt: skip


@dataclass(frozen=True)
class Diagnosis:
    """One Jenga row on one scenario (token counts over first admissions)."""

    allocator: str
    prompt_tokens: int
    hit_tokens: int
    alone_tokens: dict[str, int]  # group -> hit tokens that group alone could serve
    counters: dict[str, int]
    occupancy: dict[str, dict[str, float]]  # group -> mean pages / used / cached / free


def group_alone_hits(core: JengaAllocator, prompt: Sequence[int]) -> list[int]:
    """Per group, the longest prefix of ``prompt`` that group alone could serve now."""
    req = core._new_live("(diagnosis)", prompt, (), 0, None)
    n, step = len(req.tokens), core._prefix_step
    out = []
    for g, policy in enumerate(core.policies):
        t = policy.tokens_per_block
        found = core._core.lookup(g, req.identities(t, 0, n // t))
        mask = policy.valid_prefix_mask(found >= 0, step, n, req.images)
        if len(mask) and len(mask) * step == n:
            mask[-1] = False  # one token is always computed
        valid = np.flatnonzero(mask)
        out.append(int(valid[-1] + 1) * step if len(valid) else 0)
    return out


class _Watched:
    """Wraps a `JengaCoreAllocator`: scores every admission, samples every step."""

    def __init__(self, inner: JengaCoreAllocator) -> None:
        self.inner = inner
        self.name = inner.name
        self.use_prefix_cache = inner.use_prefix_cache
        self.samples: list[Usage] = []
        self.prompt = self.hit = 0
        self.alone = [0] * inner.core.num_groups

    def admit(self, state: RequestState) -> int:
        first = "diagnosed" not in state.scratch  # a recompute after preemption is no hit
        if first:
            prompt = self.inner._core_prompt(state)
            for g, tokens in enumerate(group_alone_hits(self.inner.core, prompt)):
                self.alone[g] += tokens
            self.prompt += len(prompt)
        hit = self.inner.admit(state)
        if first:
            self.hit += hit
            state.scratch["diagnosed"] = True
        return hit

    def allocate(self, state: RequestState, num_tokens: int) -> bool:
        return self.inner.allocate(state, num_tokens)

    def trim(self, state: RequestState) -> None:
        self.inner.trim(state)

    def release(self, state: RequestState) -> None:
        self.inner.release(state)

    def snapshot(self) -> AllocatorSnapshot:
        self.samples.append(self.inner.core.usage())
        return self.inner.snapshot()

    def check_invariants(self) -> None:
        self.inner.check_invariants()


def diagnose(scenario: Scenario, name: str) -> Diagnosis:
    model = scenario.model_spec()
    inner = make_allocator(name, model, scenario.kv_bytes(model), scenario.prefix_cache)
    if not isinstance(inner, JengaCoreAllocator):
        raise SimError(f"{name} is not a Jenga row; choose from {sorted(JENGA_NAMES)}")
    watched = _Watched(inner)
    Engine(model, get_gpu(scenario.gpu), watched, scenario.engine).run(build_trace(scenario))
    stats = inner.core.stats()
    names = [g.name for g in model.groups]
    busy = [u for u in watched.samples if sum(u.used_blocks)] or watched.samples

    def mean(values: list[int]) -> float:
        return statistics.fmean(values) if values else 0.0

    occupancy = {
        group: {
            "pages": mean([u.mapped_pages[g] for u in busy]),
            "used": mean([u.used_blocks[g] for u in busy]),
            "cached": mean([u.cached_blocks[g] for u in busy]),
            "free": mean([u.free_blocks[g] for u in busy]),
        }
        for g, group in enumerate(names)
    }
    return Diagnosis(
        name,
        watched.prompt,
        watched.hit,
        dict(zip(names, watched.alone, strict=True)),
        {k: int(stats.get(k, 0)) for k in COUNTERS},
        occupancy,
    )


def render(found: Sequence[Diagnosis]) -> str:
    lines = []
    for d in found:
        share = {g: 100 * t / d.prompt_tokens for g, t in d.alone_tokens.items()}
        alone = ", ".join(f"{g} alone {v:.1f} %" for g, v in share.items())
        lines.append(f"{d.allocator}: hit {100 * d.hit_tokens / d.prompt_tokens:.1f} % ({alone})")
        lines.append("  " + ", ".join(f"{k} {v}" for k, v in d.counters.items()))
        for g, occ in d.occupancy.items():
            lines.append(
                f"  {g}: mean {occ['pages']:.1f} pages mapped, blocks used {occ['used']:.1f} / "
                f"cached {occ['cached']:.1f} / free {occ['free']:.1f}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jenga.sim.diagnose", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--scenario", default="mamba-chat")
    p.add_argument("--kv-gib", type=float)
    p.add_argument("--allocators", help="comma-separated Jenga rows (default: the scenario's)")
    args = p.parse_args(argv)
    try:
        scenario = get_scenario(args.scenario)
        if args.kv_gib is not None:
            scenario = replace(scenario, kv_gib=args.kv_gib)
        names = (
            [a.strip() for a in args.allocators.split(",")]
            if args.allocators
            else [a for a in scenario.allocators if a in JENGA_NAMES and a != "max_page"]
        )
        print(render([diagnose(scenario, name) for name in names]))
    except SimError as exc:
        print(f"jenga.sim.diagnose: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
