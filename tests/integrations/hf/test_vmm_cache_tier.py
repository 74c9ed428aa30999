"""`VmmCache`'s host tier options: bad values are refused naming them; a valid tier is
shared by the caches of one pool (multi-turn behaviour: test_vmm_cache_conversations)."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from integrations.kvcache.tier import host_memory_bytes  # noqa: E402
from jenga.errors import InvalidSize  # noqa: E402

from integrations.hf import VmmCache  # noqa: E402


def config():
    return transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=512, num_hidden_layers=2,
    )  # fmt: skip


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(tier_bytes=0), "size_bytes must be an int > 0, got 0"),
        (dict(tier_bytes=-4), "got -4"),
        (dict(tier_bytes=1.5), "got 1.5"),
        (dict(tier_bytes=host_memory_bytes() + 1), "is larger than host memory"),
        (
            dict(tier_bytes=1 << 20, tier_high_water=0.0),
            "high-water mark must be in (0, 1], got 0.0",
        ),
        (dict(tier_high_water=1.5), "high-water mark must be in (0, 1], got 1.5"),
        (dict(tier_high_water=float("nan")), "got nan"),
        (dict(tier_policy="fifo"), "tier policy must be one of ['lru', 'score'], got 'fifo'"),
    ],
)
def test_bad_tier_options_are_refused_naming_them(options, message):
    with pytest.raises(InvalidSize) as err:
        VmmCache(config(), **options)
    assert "VmmCache tier options" in str(err.value) and message in str(err.value)


@pytest.mark.parametrize("policy", ["lru", "score"])
def test_caches_of_one_pool_share_one_tier_and_must_agree_on_it(policy):
    import vmm

    pool = vmm.ChunkPool(vmm.get_backend("host", granularity=4096), 64 * 4096)
    try:
        a = VmmCache(config(), pool=pool, tier_bytes=1 << 20, tier_policy=policy)
        b = VmmCache(config(), pool=pool, tier_bytes=1 << 20, tier_policy=policy)
        assert a.tier is b.tier and a.tier is not None
        assert a.tier.rules.policy.value == policy
        with pytest.raises(ValueError, match="differ from the tier of this pool"):
            VmmCache(config(), pool=pool, tier_bytes=2 << 20, tier_policy=policy)
        own = VmmCache(config(), tier_bytes=1 << 20)  # its own pool: its own tier
        assert own.tier is not a.tier
        for cache in (a, b, own):
            cache.close()
        assert a.tier.stats()["tier.members.current"] == 0
    finally:
        pool.close()


def test_a_tier_is_refused_for_state_groups():
    jamba = transformers.JambaConfig(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1,
        expert_layer_period=100, num_experts=1,
    )  # fmt: skip
    with pytest.raises(ValueError, match="keeps attention groups only"):
        VmmCache(jamba, tier_bytes=1 << 20)


def test_without_a_tier_the_defaults_construct():
    cache = VmmCache(config(), tier_policy="score", tier_high_water=1.0)
    assert not cache.store.is_open
