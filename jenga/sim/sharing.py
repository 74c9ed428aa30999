"""Memory saved by sharing KV blocks between parallel samples and beams (PagedAttention §6.3).

Rationale
    Parallel sampling and beam search run several sequences over one prompt. PagedAttention
    (§4.4) stores their common blocks once (reference counts, copy-on-write of the partly
    filled block) and reports the saving in its Fig. 15: blocks saved by sharing over the
    blocks the same sequences take without sharing, averaged while serving OPT-13B on
    Alpaca (6.1-9.8 % for 2-6 samples, 37.6-55.2 % for beam width 2-6) and ShareGPT
    (16.2-30.5 %, 44.3-66.3 %). These scenarios measure the same quantity for the project's
    allocator (`JengaAllocator.fork`) beside a model of vLLM's block manager.

Approach
    A trace of requests with Alpaca- or ShareGPT-like lengths (log-normal, the means of
    PagedAttention's Fig. 11, prompt + output capped at OPT-13B's 2,048 positions) is
    served with continuous batching: a request is admitted while the running sequences
    stay within ``max_num_seqs``; its prompt is allocated at once; then every step each
    running sequence gets one token. After the prompt the request forks into its ``n``
    samples or ``k`` beams. A beam step draws each new beam's parent among the old beams
    (rank r with weight ``beam_skew ** r``, sorted so one parent's children are adjacent):
    the first child continues the parent, the others fork it, a parent no child continues
    is freed. Samples and beams generate the request's output length (no EOS).

    Every step counts the blocks held three ways, summed over the run:

    - ``none``: each sequence its own ``ceil(tokens / block_size)`` blocks;
    - ``vllm``: `VllmBlocks`, PagedAttention's block manager (fork copies the block table
      and takes a reference on each block; appending into a shared partly filled block
      copies it; a full block starts a new one);
    - ``jenga``: the real `JengaAllocator` (C++ core) driven by `fork`, `allocate` and
      `free` on one full-attention group (``used_blocks``).

    Saving = 1 - blocks / none blocks. ``jenga`` equal to ``vllm`` shows the allocator's
    forks share exactly as PagedAttention does.

Limitations
    The beam ancestry is synthetic (no model runs): real beams' parents depend on the
    logits, so beam savings follow ``beam_skew``; sampling savings depend only on the
    lengths. No memory limit or preemption (the saving is a ratio of blocks held).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from jenga.allocator import AllocatorConfig, GroupConfig, JengaAllocator
from jenga.sim.protocol import SimError
from jenga.specs import Kind

MAX_POSITIONS = 2048  # OPT-13B, PagedAttention's §6.3 model
DATASETS = {  # (mean input, mean output) tokens: PagedAttention Fig. 11
    "alpaca": (19.31, 58.45),
    "sharegpt": (161.31, 337.99),
}
# PagedAttention Fig. 15 / §6.3: memory saved by sharing, width 2, 4, 6 (ShareGPT: the
# range over 2-6 the text reports, per width not given)
PAPER_SAVING = {
    ("alpaca", "sample"): {2: 6.09, 4: 8.53, 6: 9.79},
    ("alpaca", "beam"): {2: 37.56, 4: 53.13, 6: 55.16},
}
PAPER_RANGE = {
    ("alpaca", "sample"): (6.1, 9.8),
    ("alpaca", "beam"): (37.6, 55.2),
    ("sharegpt", "sample"): (16.2, 30.5),
    ("sharegpt", "beam"): (44.3, 66.3),
}


@dataclass(frozen=True)
class SharingScenario:
    """One dataset, one decoding mode, several widths (n samples or beam width)."""

    name: str
    dataset: str
    mode: str  # "sample" | "beam"
    widths: tuple[int, ...] = (2, 4, 6)
    num_requests: int = 200
    max_num_seqs: int = 256  # vLLM's default running-sequence limit
    block_size: int = 16
    beam_skew: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise SimError(f"dataset must be one of {sorted(DATASETS)}, got {self.dataset!r}")
        if self.mode not in ("sample", "beam"):
            raise SimError(f"mode must be 'sample' or 'beam', got {self.mode!r}")
        for what, value in (("num_requests", self.num_requests), ("block_size", self.block_size),
                            ("max_num_seqs", self.max_num_seqs)):  # fmt: skip
            if type(value) is not int or value <= 0:
                raise SimError(f"{what} must be an int > 0, got {value!r}")
        bad = [w for w in self.widths if type(w) is not int or w < 1 or w > self.max_num_seqs]
        if not self.widths or bad:
            raise SimError(
                f"widths must be ints in [1, max_num_seqs={self.max_num_seqs}], got {bad or '()'}"
            )
        if not 0.0 < self.beam_skew <= 1.0:
            raise SimError(f"beam_skew must be in (0, 1], got {self.beam_skew}")


SCENARIOS = {
    s.name: s
    for s in (
        SharingScenario("sampling-alpaca", "alpaca", "sample"),
        SharingScenario("beam-alpaca", "alpaca", "beam"),
        SharingScenario("sampling-sharegpt", "sharegpt", "sample", num_requests=100),
        SharingScenario("beam-sharegpt", "sharegpt", "beam", num_requests=100),
    )
}


def lengths(dataset: str, num: int, rng: random.Random) -> list[tuple[int, int]]:
    """(prompt, output) tokens: log-normal (sigma 0.8) with the dataset's means, the sum
    capped at `MAX_POSITIONS` (the output gives way first)."""
    sigma = 0.8
    out = []
    for _ in range(num):
        mean_in, mean_out = DATASETS[dataset]
        p = rng.lognormvariate(math.log(mean_in) - sigma * sigma / 2, sigma)
        o = rng.lognormvariate(math.log(mean_out) - sigma * sigma / 2, sigma)
        prompt = max(1, min(MAX_POSITIONS - 1, round(p)))
        out.append((prompt, max(1, min(MAX_POSITIONS - prompt, round(o)))))
    return out


@dataclass
class VllmBlocks:
    """PagedAttention's block manager: block tables of physical ids with reference counts."""

    block_size: int
    tables: dict[object, list[int]] = field(default_factory=dict)
    lengths: dict[object, int] = field(default_factory=dict)
    refs: dict[int, int] = field(default_factory=dict)
    _next: int = 0

    def _new(self) -> int:
        self._next += 1
        self.refs[self._next] = 1
        return self._next

    def add(self, seq: object, tokens: int) -> None:
        self.tables[seq] = [self._new() for _ in range(-(-tokens // self.block_size))]
        self.lengths[seq] = tokens

    def fork(self, parent: object, children: Sequence[object]) -> None:
        for child in children:
            self.tables[child] = list(self.tables[parent])
            self.lengths[child] = self.lengths[parent]
            for b in self.tables[child]:
                self.refs[b] += 1

    def append(self, seq: object) -> None:
        table, n = self.tables[seq], self.lengths[seq]
        if n % self.block_size == 0:
            table.append(self._new())
        elif self.refs[table[-1]] > 1:  # copy-on-write of the shared partly filled block
            self.refs[table[-1]] -= 1
            table[-1] = self._new()
        self.lengths[seq] = n + 1

    def free(self, seq: object) -> None:
        for b in self.tables.pop(seq):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                del self.refs[b]
        del self.lengths[seq]

    @property
    def used(self) -> int:
        return len(self.refs)


@dataclass
class _Group:
    """One request: its sequences (ids, current tokens) and what is left to generate."""

    rid: int
    width: int
    prompt: int
    left: int
    seqs: list[int] = field(default_factory=list)  # sequence ids, beam order
    stepped: bool = False


class _Run:
    """One width of one scenario: the three block counts, step by step."""

    def __init__(self, scenario: SharingScenario, width: int) -> None:
        self.s, self.width = scenario, width
        self.vllm = VllmBlocks(scenario.block_size)
        group = GroupConfig("full", Kind.FULL, scenario.block_size, 1)
        self.jenga = JengaAllocator(AllocatorConfig((group,), 1 << 24), guard_threads=False)
        self.rng = random.Random(scenario.seed * 1_000 + width)
        self.tokens: dict[int, int] = {}  # sequence -> tokens held
        self._ids = 0
        self.totals = {"none": 0, "vllm": 0, "jenga": 0}
        self.steps = 0

    def _new_id(self) -> int:
        self._ids += 1
        return self._ids

    def admit(self, g: _Group) -> None:
        seq = self._new_id()
        self.jenga.add_request(seq, [0] * g.prompt, use_cache=False)
        if self.jenga.allocate(seq, g.prompt) is None:
            raise SimError(f"request {g.rid}: {g.prompt} prompt tokens do not fit")
        self.vllm.add(seq, g.prompt)
        self.tokens[seq] = g.prompt
        g.seqs = [seq]
        self._remap(g, [0] * g.width)  # samples or beams fork from the prompt

    def _remap(self, g: _Group, parents: list[int]) -> None:
        """New sequence i continues old sequence ``parents[i]`` (sorted)."""
        old = list(g.seqs)
        new: list[int] = []
        kids: dict[int, list[int]] = {}
        for p in parents:
            if old[p] in new:
                kid = self._new_id()
                kids.setdefault(old[p], []).append(kid)
                self.tokens[kid] = self.tokens[old[p]]
                new.append(kid)
            else:
                new.append(old[p])
        for parent, children in kids.items():
            self.jenga.fork(parent, children)
            self.vllm.fork(parent, children)
        for seq in old:
            if seq not in new:
                self._free(seq)
        g.seqs = new

    def _free(self, seq: int) -> None:
        self.jenga.free(seq)
        self.vllm.free(seq)
        del self.tokens[seq]

    def step(self, g: _Group) -> None:
        """One token for every sequence of `g` (a beam step first picks the parents)."""
        if self.s.mode == "beam" and g.stepped:  # the first beams came from the prompt
            weights = [self.s.beam_skew**r for r in range(g.width)]
            self._remap(g, sorted(self.rng.choices(range(g.width), weights, k=g.width)))
        g.stepped = True
        for seq in g.seqs:
            if self.jenga.allocate(seq, 1) is None:
                raise SimError(f"sequence {seq}: the allocator ran out of {1 << 24} units")
            self.vllm.append(seq)
            self.tokens[seq] += 1
        g.left -= 1

    def count(self) -> None:
        bs = self.s.block_size
        self.totals["none"] += sum(-(-n // bs) for n in self.tokens.values())
        self.totals["vllm"] += self.vllm.used
        self.totals["jenga"] += self.jenga.usage().used_blocks[0]
        self.steps += 1

    def finish(self, g: _Group) -> None:
        for seq in g.seqs:
            self._free(seq)


@dataclass(frozen=True)
class WidthResult:
    width: int
    steps: int
    blocks: dict[str, int]  # blocks held summed over steps: none, vllm, jenga

    def saving(self, how: str) -> float:
        """Percent of the no-sharing blocks that sharing saves."""
        return 100.0 * (1.0 - self.blocks[how] / self.blocks["none"])


def run_width(
    scenario: SharingScenario, width: int, trace: list[tuple[int, int]] | None = None
) -> WidthResult:
    """Serve the scenario's trace (or `trace`: (prompt, output) tokens per request) with
    every request forked into `width` sequences."""
    if trace is None:
        trace = lengths(scenario.dataset, scenario.num_requests, random.Random(scenario.seed))
    waiting = [_Group(i, width, p, o) for i, (p, o) in enumerate(trace)]
    waiting.reverse()
    run = _Run(scenario, width)
    running: list[_Group] = []
    while waiting or running:
        while waiting and (len(running) + 1) * width <= scenario.max_num_seqs:
            g = waiting.pop()
            run.admit(g)  # prefill: the prompt's blocks, then the fork
            running.append(g)
        for g in running:
            run.step(g)
        run.count()
        for g in [g for g in running if g.left == 0]:
            run.finish(g)
            running.remove(g)
    run.jenga.check_invariants(expensive=False)
    if run.jenga.usage().used_blocks[0] or run.vllm.used:
        raise SimError("blocks left after every request finished")
    return WidthResult(width, run.steps, dict(run.totals))


def run_scenario(scenario: SharingScenario) -> list[WidthResult]:
    return [run_width(scenario, w) for w in scenario.widths]
