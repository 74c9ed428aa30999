"""MiniEngine with a host tier: a GPU pool too small for a multi-turn working set gives the
tokens of an unbounded pool, and the second turns hit blocks reloaded from the host."""

from __future__ import annotations

import threading

import pytest
import torch

transformers = pytest.importorskip("transformers")

from jenga.errors import InvalidSize  # noqa: E402

from integrations.engine import EngineConfig, MiniEngine  # noqa: E402

from .test_engine import CHUNK, SMALL, reference, tiny  # noqa: E402

SMALL_POOL = 16 * CHUNK  # 8 large pages of 4 blocks: under two conversations' prefixes
BIG_POOL = 256 * CHUNK


def chat(turns: int = 2, convs: int = 3, prefix: int = 40) -> list[tuple[str, list[int], int, int]]:
    """``convs`` conversations with a ``prefix``-token history each; turn t of
    conversation c arrives at step 30 t + 8 c, so each turn runs after every other
    conversation's previous turn pushed its prefix off the small pool."""
    gen = torch.Generator().manual_seed(5)
    prefixes = [torch.randint(0, 128, (prefix,), generator=gen).tolist() for _ in range(convs)]
    out = []
    for t in range(turns):
        for c in range(convs):
            tail = torch.randint(0, 128, (6,), generator=gen).tolist()
            out.append((f"c{c}t{t}", prefixes[c] + tail, 6, 30 * t + 8 * c))
    return out


def run(model, requests, **config) -> tuple[dict, dict, MiniEngine]:
    config.setdefault("chunk_bytes", CHUNK)
    config.setdefault("token_budget", 32)
    config.setdefault("max_running", 2)
    engine = MiniEngine(model, EngineConfig(block_size=4, **config))
    for rid, prompt, n, arrival in requests:
        engine.add_request(rid, prompt, n, arrival_step=arrival)
    outputs = engine.run()
    engine.kv.check_invariants(expensive=True)
    stats = {**engine.kv.stats(), **engine.stats}
    if engine.tier is not None:
        stats.update(engine.tier.stats)
    return outputs, stats, engine


@pytest.fixture(scope="module")
def setup():
    model = tiny("llama")
    requests = chat()
    unbounded, stats, engine = run(model, requests, budget_bytes=BIG_POOL)
    engine.close()
    assert stats["blocks.evicted"] == 0
    return model, requests, unbounded, stats


@pytest.mark.parametrize("policy", ["lru", "score"])
@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("overlap", [True, False])
def test_tier_on_small_pool_matches_unbounded_pool_with_host_hits(setup, policy, prefetch, overlap):
    model, requests, unbounded, big = setup
    out, stats, engine = run(
        model, requests, budget_bytes=SMALL_POOL, tier_bytes=1 << 20, tier_policy=policy,
        tier_prefetch=prefetch, tier_overlap=overlap,
    )  # fmt: skip
    assert out == unbounded == reference(model, requests)
    assert stats["blocks.evicted"] > 0  # the pool is too small for the working set
    assert stats["tier.hits"] == 3  # every second turn's prefix came back from the host
    assert stats["tier.hit_tokens"] == stats["tier.reload.tokens"] > 0
    assert stats["tokens.computed"] == big["tokens.computed"]  # nothing recomputed
    assert stats["tier.reload.failed"] == 0
    assert set(engine.ttft) == {rid for rid, *_ in requests}
    assert all(t > 0 for t in engine.ttft.values())
    engine.close()


def test_without_the_tier_the_small_pool_recomputes(setup):
    model, requests, unbounded, big = setup
    out, stats, engine = run(model, requests, budget_bytes=SMALL_POOL)
    assert out == unbounded
    assert stats["tokens.computed"] > big["tokens.computed"]
    assert engine.tier is None and "tier.hits" not in stats
    engine.close()


@pytest.mark.parametrize(
    "config, message",
    [
        (dict(tier_bytes=0), "size_bytes must be an int > 0, got 0"),
        (dict(tier_bytes=1 << 60), f"host tier of {1 << 60} B is larger than host memory"),
        (
            dict(tier_bytes=1 << 20, tier_high_water=0.0),
            "high-water mark must be in (0, 1], got 0.0",
        ),
        (dict(tier_bytes=1 << 20, tier_high_water=1.2), "got 1.2"),
        (dict(tier_bytes=1 << 20, tier_policy="fifo"), "got 'fifo'"),
    ],
)
def test_bad_tier_options_are_refused_by_engine_config(config, message):
    with pytest.raises(InvalidSize) as err:
        EngineConfig(**config)
    assert message in str(err.value)


def long_chat_model():
    config = transformers.LlamaConfig(**{**SMALL, "max_position_embeddings": 4096})
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def long_chat_on(backend: str) -> None:
    """2 MiB chunks: one large page (a chunk per layer) holds 8192 tokens, the pool one page,
    three 3000-token conversation histories do not fit."""
    model = long_chat_model().to("cuda" if backend == "cuda" else "cpu")
    requests = chat(prefix=3000)
    kwargs = dict(backend=backend, chunk_bytes=2 << 20, token_budget=512)
    unbounded, big, engine = run(model, requests, budget_bytes=64 << 21, **kwargs)
    engine.close()
    out, stats, engine = run(model, requests, budget_bytes=2 << 21, tier_bytes=64 << 20, **kwargs)
    assert out == unbounded
    assert stats["blocks.evicted"] > 0 and stats["tier.hits"] > 0
    assert stats["tokens.computed"] == big["tokens.computed"]
    engine.close()


@pytest.mark.slow
def test_long_histories_on_2mib_host_chunks_match_unbounded_pool():
    long_chat_on("host")


@pytest.mark.cuda
@pytest.mark.gpu
def test_tier_on_cuda_matches_unbounded_pool_with_host_hits():
    """The same on a CUDA pool: copies on the tier's own stream, pinned host memory."""
    long_chat_on("cuda")


@pytest.mark.parametrize("overlap", [False, True])
def test_tier_with_preemption_and_overlap_keeps_tokens(setup, overlap):
    """Every turn arrives at once: four running requests on the small pool preempt each
    other; preempted requests and later turns come back through the prefix cache, partly
    from the host (with overlap, decode tokens are allocated a step ahead and evictions
    pass the tier there too)."""
    model, requests, unbounded, _ = setup
    requests = [(rid, prompt, n, 0) for rid, prompt, n, _ in requests]
    out, stats, engine = run(
        model, requests, budget_bytes=12 * CHUNK, tier_bytes=1 << 20, max_running=4,
        overlap=overlap, token_budget=64,
    )  # fmt: skip
    assert out == unbounded
    assert stats["preemptions"] > 0
    assert stats["tier.hits"] > 0 and stats["tier.reload.failed"] == 0
    engine.close()


def overlap_engine(model, **config) -> MiniEngine:
    """The small pool with a tier, reloads started at admission (no prefetch) and no
    background offload (the copy thread only runs reloads)."""
    return MiniEngine(model, EngineConfig(
        block_size=4, chunk_bytes=CHUNK, token_budget=32, max_running=2,
        budget_bytes=SMALL_POOL, tier_bytes=1 << 20, tier_prefetch=False,
        tier_high_water=1.0, **config,
    ))  # fmt: skip


def test_a_request_s_step_starts_before_its_reload_s_last_layer_landed(setup, monkeypatch):
    """The last layer's copy is held until a forward waits for layer 0 of an open reload:
    an engine that waited for the whole reload before the step would never release it
    (the copy then fails after 20 s and the request recomputes)."""
    model, requests, unbounded, big = setup
    engine = overlap_engine(model)
    tier = engine.kv.tier
    assert tier is not None
    last = len(tier._units[0]) - 1
    reached = threading.Event()
    order: list[tuple[str, int]] = []
    real_load, real_wait = tier._load_unit, tier.wait_layer

    def load(g: int, i: int, pairs: list) -> None:
        if i == last and not reached.wait(timeout=20):
            raise TimeoutError("no forward reached layer 0 before the last layer's copy")
        real_load(g, i, pairs)
        order.append(("landed", i))

    def wait(layer: int) -> None:
        if tier.open_reloads():
            order.append(("forward", layer))
            if layer == 0:
                reached.set()
        real_wait(layer)

    monkeypatch.setattr(tier, "_load_unit", load)
    monkeypatch.setattr(tier, "wait_layer", wait)
    for rid, prompt, n, arrival in requests:
        engine.add_request(rid, prompt, n, arrival_step=arrival)
    assert engine.run() == unbounded
    stats = {**engine.kv.stats(), **engine.stats, **engine.tier.stats}
    assert stats["tier.reload.failed"] == 0 and stats["tier.reload.opened"] == 3
    assert stats["tier.hits"] == 3 and stats["tokens.computed"] == big["tokens.computed"]
    assert order.index(("forward", 0)) < order.index(("landed", last))
    assert ("forward", last) in order  # the forward waited for the held copy at its layer
    engine.kv.check_invariants(expensive=True)
    engine.close()


def test_without_overlap_the_whole_reload_lands_before_the_step(setup, monkeypatch):
    model, requests, unbounded, big = setup
    engine = overlap_engine(model, tier_overlap=False)
    tier = engine.kv.tier
    assert tier is not None
    for rid, prompt, n, arrival in requests:
        engine.add_request(rid, prompt, n, arrival_step=arrival)
    assert engine.run() == unbounded
    stats = {**engine.kv.stats(), **engine.stats, **engine.tier.stats}
    assert stats["tier.reload.opened"] == 0 and stats["tier.hits"] == 3
    assert stats["tokens.computed"] == big["tokens.computed"]
    engine.close()


@pytest.mark.parametrize("attention", ["sdpa", "flash"])
def test_a_copy_failing_under_the_step_requeues_its_request(setup, monkeypatch, attention):
    """Layer 1's copy of the first reload fails while the request's forward waits for it:
    its blocks leave the prefix cache (nothing half-loaded is read), the request is
    requeued; tokens are unchanged."""
    model, requests, unbounded, big = setup
    engine = overlap_engine(model, attention=attention)
    tier = engine.kv.tier
    assert tier is not None
    real = tier._load_unit
    failed: list[int] = []

    def load(g: int, i: int, pairs: list) -> None:
        if i == 1 and not failed:
            failed.append(i)
            raise OSError("injected copy failure")
        real(g, i, pairs)

    monkeypatch.setattr(tier, "_load_unit", load)
    for rid, prompt, n, arrival in requests:
        engine.add_request(rid, prompt, n, arrival_step=arrival)
    assert engine.run() == unbounded
    stats = {**engine.kv.stats(), **engine.stats, **engine.tier.stats}
    assert failed and stats["tier.reload.failed"] == 1
    assert stats["preemptions"] == 1  # the request on the failed reload, requeued
    # its host copy is intact: requeued, it is reloaded again (all three second turns hit)
    assert stats["tier.hits"] == 3 and stats["tier.reload.opened"] == 4
    assert stats["tokens.computed"] == big["tokens.computed"]
    engine.kv.check_invariants(expensive=True)
    engine.close()
