"""The C++ core against its Python twin (`tests.jenga.core_model`), one rules value at a time.

A plain seeded random driver (no Hypothesis: it must run hundreds of thousands of steps in
CI time) replays the same operations on `jenga._core.Core` and on `CoreModel` and stops at
the first divergence: an answer (block ids, None, commit counts, lookups, plan ops, a
raised error) or, after every step, the state both expose (free units, each group's block
eviction order, the page eviction order); the core's expensive invariants are checked too.

RUNS lists every rule of the core's ``JENGA_RULES`` (`jenga._core.Rules`) by name, each
set to each of its non-default values in some run; a test asserts that this list equals
the rules the core has, so a new rule cannot be left out of the twin. In each run the
rules a run does not fix are drawn at random per episode (shapes and pools too), so every
rule also runs beside the others.

`test_twin_without_pinned_lru_fair_diverges` shows that the replay catches a missing rule:
the twin with ``pinned_lru_fair`` ignored (the model as it was) diverges from the core.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from jenga import _core as J
from tests.jenga.core_model import MAP, CoreModel

ROOT = Path(__file__).resolve().parents[2]
NUM_HASHES = 24  # a small hash space: duplicate commits and shared prefixes happen often
STEPS_PER_RUN = 50_000
EPISODE_STEPS = 250
ORDERS = J.AllocationOrder.__members__

# Each run fixes these rules (the others are drawn per episode). Every rule appears with
# every value that differs from its default; "drawn" early_release_groups: one random
# flag per group, at least one set; "drawn" window_blocks: 1-4 per early group, else 0.
RUNS: dict[str, dict[str, Any]] = {
    "paper": {"order": "PAPER"},
    "compact": {"order": "COMPACT"},
    "pinned": {"order": "PINNED", "pinned_lru_fair": False},
    "pinned_lru_fair": {"order": "PINNED", "pinned_lru_fair": True},
    "no_frugal_retry": {"frugal_retry": False},
    "early_release_groups": {"early_release_groups": "drawn"},
    "demote_window_releases": {"demote_window_releases": True, "early_release_groups": "drawn"},
    "reuse_window_releases": {
        "demote_window_releases": True,
        "reuse_window_releases": True,
        "early_release_groups": "drawn",
    },
    "pack_window_blocks": {
        "demote_window_releases": True,
        "pack_window_blocks": True,
        "early_release_groups": "drawn",
        "window_blocks": "drawn",
    },
    "retention": {
        "retention_interval": "drawn",
        "retention_reach": "drawn",
        "early_release_groups": "drawn",
    },
}
DRAWN = ("early_release_groups", "window_blocks", "retention_interval", "retention_reach")


def _core_rule_names() -> set[str]:
    """The rules of JENGA_RULES in csrc/jenga/core.hpp (`X(type, name, ...)` lines)."""
    text = (ROOT / "csrc" / "jenga" / "core.hpp").read_text()
    block = text[text.index("#define JENGA_RULES(X)") : text.index("struct Rules {")]
    return set(re.findall(r"\bX\(\s*[\w:<>]+\s*,\s*(\w+)\s*,", block))


def test_runs_cover_every_rule_of_the_core() -> None:
    bound = {n for n, v in vars(J.Rules).items() if isinstance(v, property)}
    assert _core_rule_names() == bound  # the binding is generated from the same list
    default = J.Rules()
    covered = {
        (name, value)
        for run in RUNS.values()
        for name, value in run.items()
        if name == "order" or value != getattr(default, name)
    }
    expected = {("order", name) for name in ORDERS} | {
        (name, "drawn" if name in DRAWN else not getattr(default, name))
        for name in bound - {"order"}
    }
    assert covered == expected


def _draw_rules(rng: random.Random, fixed: dict[str, Any], groups: int) -> J.Rules:
    values: dict[str, Any] = {
        "order": rng.choice(list(ORDERS)),
        "frugal_retry": rng.random() < 0.5,
        "demote_window_releases": rng.random() < 0.5,
        "reuse_window_releases": rng.random() < 0.5,
        "pinned_lru_fair": rng.random() < 0.5,
        "pack_window_blocks": rng.random() < 0.5,
        "early_release_groups": "drawn" if rng.random() < 0.5 else "none",
        "window_blocks": "drawn" if rng.random() < 0.5 else "none",
        "retention_interval": "drawn" if rng.random() < 0.5 else "none",
        "retention_reach": "drawn" if rng.random() < 0.5 else "none",
    }
    values.update(fixed)
    flags = [False] * groups
    if values["early_release_groups"] == "drawn":
        flags = [rng.random() < 0.5 for _ in range(groups)]
        flags[rng.randrange(groups)] = True
    values["early_release_groups"] = flags
    drawn = values["window_blocks"] == "drawn"
    values["window_blocks"] = [rng.randint(1, 4) if f and drawn else 0 for f in flags]
    # retention: boundaries every 2-4 prefix steps; a reach of -1 (not thinned) to 3 each
    drawn = values["retention_interval"] == "drawn"
    values["retention_interval"] = rng.randint(2, 4) if drawn else 0
    drawn = values["retention_reach"] == "drawn"
    values["retention_reach"] = [rng.randint(-1, 3) if drawn else -1 for _ in flags]
    values["order"] = ORDERS[values["order"]]
    return J.Rules(**values)


class Divergence(AssertionError):
    pass


def same(what: str, got: object, want: object) -> None:
    if got != want:
        raise Divergence(f"{what}: core {got!r}, twin {want!r}")


@dataclass
class Episode:
    """One core and its twin from an empty pool, driven by rng."""

    rng: random.Random
    rules: J.Rules
    model_type: type[CoreModel]
    bpp: list[int] = field(default_factory=list)
    upp: list[int] = field(default_factory=list)
    total: int = 0

    def __post_init__(self) -> None:
        rng = self.rng
        groups = len(self.rules.early_release_groups)  # one flag per group
        self.total = rng.randint(3, 12)
        self.bpp = [rng.randint(1, 4) for _ in range(groups)]
        self.upp = [min(rng.randint(1, 3), self.total) for _ in range(groups)]
        self.core = J.Core(self.bpp, self.upp, self.total, self.rules)
        self.model = self.model_type(self.bpp, self.upp, self.total, self.rules)
        self.G = groups
        self.now = 0
        self.held: dict[int, list[list[int]]] = {}  # owner -> per group blocks (repeats)
        self.next_owner = 0
        self.mapped: set[tuple[int, int]] = set()

    def tick(self) -> int:
        self.now += 1
        return self.now

    def new_owner(self) -> int:
        owner = self.next_owner
        self.next_owner += 1
        self.held[owner] = [[] for _ in range(self.G)]
        return owner

    def some_owner(self) -> int:
        return self.rng.choice(sorted(self.held))

    def subset(self, items: list[int]) -> list[int]:
        return [b for b in items if self.rng.random() < 0.5]

    def step(self) -> None:
        r = self.rng.random()
        if r < 0.45 or not self.held:
            self.allocate()
        elif r < 0.65:
            self.release()
        elif r < 0.85:
            self.commit()
        elif r < 0.97:
            self.hit()
        else:
            self.bad_release()
        self.compare()

    def allocate(self) -> None:
        rng = self.rng
        owner = self.new_owner() if not self.held or rng.random() < 0.25 else self.some_owner()
        counts = [rng.randint(0, 2) for _ in range(self.G)]
        releases = [self.subset(sorted(set(self.held[owner][g]))) for g in range(self.G)]
        now = self.tick()
        got = self.core.allocate(owner, counts, now, releases)
        same(
            f"allocate({owner}, {counts}, {now}, {releases})",
            got,
            self.model.allocate(owner, counts, now, releases),
        )
        if got is not None:
            for g in range(self.G):
                for b in releases[g]:
                    self.held[owner][g].remove(b)
                self.held[owner][g].extend(got[g])

    def release(self) -> None:
        owner = self.some_owner()
        finish = self.rng.random() < 0.5
        now = self.tick()
        for g in range(self.G):
            blocks = list(self.held[owner][g])
            if not finish:
                blocks = sorted(set(self.subset(blocks)))
            self.core.release(g, blocks, now)
            self.model.release(g, blocks, now)
            for b in blocks:
                self.held[owner][g].remove(b)
        if finish:
            del self.held[owner]

    def commit(self) -> None:
        g = self.rng.randrange(self.G)
        blocks = self.subset(sorted(set(self.held[self.some_owner()][g])))
        if not blocks:
            return
        hashes = [self.rng.randrange(NUM_HASHES) for _ in blocks]
        prefixes = [self.rng.randint(1, 8) for _ in blocks]
        same(
            f"commit({g}, {blocks}, {hashes})",
            self.core.commit(g, blocks, hashes, prefixes),
            self.model.commit(g, blocks, hashes, prefixes),
        )

    def hit(self) -> None:
        """A prefix hit: look a hash up; a new or live owner takes a reference."""
        g = self.rng.randrange(self.G)
        h = self.rng.randrange(NUM_HASHES)
        found = self.core.lookup(g, [h]).tolist()
        same(f"lookup({g}, [{h}])", found, self.model.lookup(g, [h]))
        if found[0] < 0:
            return
        owner = self.new_owner() if self.rng.random() < 0.5 else self.some_owner()
        now = self.tick()
        self.core.acquire(g, found, now)
        self.model.acquire(g, found, now)
        self.held[owner][g].append(found[0])

    def bad_release(self) -> None:
        g = self.rng.randrange(self.G)
        block = self.rng.randint(-1, 40)
        if any(block in h[g] for h in self.held.values()):
            return
        with pytest.raises(ValueError):
            self.core.release(g, [block], self.tick())

    def compare(self) -> None:
        core, model = self.core, self.model
        ops = core.drain_plan()
        same("plan", ops, model.drain_plan())
        for kind, g, p, _ in ops:
            key = (g, p)
            assert (key not in self.mapped) if kind == MAP else (key in self.mapped), ops
            (self.mapped.add if kind == MAP else self.mapped.remove)(key)
        same("free units", core.free_units, model.free_units)
        same("page eviction order", core.page_eviction_order(), model.page_eviction_order())
        for g in range(self.G):
            same(f"group {g} eviction order", core.eviction_order(g), model.eviction_order(g))
        core.check_invariants(True)


def replay(
    fixed: dict[str, Any], seed: int, steps: int, model_type: type[CoreModel]
) -> tuple[int, Counter[int | str]]:
    """Run episodes until `steps` steps ran; raises Divergence at the first disagreement.
    Returns the number of steps that ran and how often each of the twin's steps served
    (`CoreModel.served`, summed over the episodes)."""
    rng = random.Random(seed)
    done = 0
    served: Counter[int | str] = Counter()
    while done < steps:
        groups = rng.randint(1, 3)
        rules = _draw_rules(rng, fixed, groups)
        episode = Episode(rng, rules, model_type)
        for _ in range(min(EPISODE_STEPS, steps - done)):
            try:
                episode.step()
            except Divergence as e:
                raise Divergence(f"rules {_fields(rules)}, step {done}: {e}") from None
            done += 1
        served += episode.model.served
    return done, served


def _fields(rules: J.Rules) -> dict[str, Any]:
    return {n: getattr(rules, n) for n, v in vars(J.Rules).items() if isinstance(v, property)}


# What each run must exercise in the twin (step ids as in the core: 6 step 5 on pinned
# pages, 7 and 8 the frugal retry's spare steps, 9 window-release reuse; "lru_fair_yield":
# step 6 gave way to an older wholly evictable page), so a run cannot pass by never
# reaching its rule.
MUST_SERVE: dict[str, set[int | str]] = {
    "paper": {1, 2, 3, 4, 5, 7, 8},
    "compact": {1, 2, 3, 4, 5},
    "pinned": {1, 2, 3, 4, 5, 6},
    "pinned_lru_fair": {1, 2, 3, 4, 5, 6, "lru_fair_yield"},
    "no_frugal_retry": {1, 2, 3, 4, 5},
    "early_release_groups": {1, 2, 3, 4, 5},
    "demote_window_releases": {1, 2, 3, 4, 5},
    "reuse_window_releases": {1, 2, 3, 4, 5, 9},
    "pack_window_blocks": {1, 2, 3, 4, 5, 10},
    "retention": {1, 2, 3, 4, 5},
}


@pytest.mark.parametrize("run", sorted(RUNS))
def test_core_matches_twin(run: str) -> None:
    seed = sorted(RUNS).index(run)
    done, served = replay(RUNS[run], seed, STEPS_PER_RUN, CoreModel)
    assert done == STEPS_PER_RUN
    assert {step for step, times in served.items() if times >= 20} >= MUST_SERVE[run], served
    if run == "no_frugal_retry":
        assert served[7] + served[8] == 0  # no frugal pass ran


class TwinWithoutPinnedLruFair(CoreModel):
    """The twin as it was before it knew ``pinned_lru_fair`` (plain PINNED order)."""

    knows_pinned_lru_fair = False


def test_twin_without_pinned_lru_fair_diverges() -> None:
    fixed = RUNS["pinned_lru_fair"]
    with pytest.raises(Divergence):
        replay(fixed, seed=1, steps=STEPS_PER_RUN, model_type=TwinWithoutPinnedLruFair)


class TwinWithoutRetention(CoreModel):
    """The twin as it was before it knew ``retention_interval`` (no early block demoted
    for lying away from a retention boundary)."""

    knows_retention = False


def test_twin_without_retention_diverges() -> None:
    with pytest.raises(Divergence):
        replay(RUNS["retention"], seed=1, steps=STEPS_PER_RUN, model_type=TwinWithoutRetention)
