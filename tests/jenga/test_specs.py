"""LayerSpec / KVGroup / ModelSpec: sizes, sharing, token fractions, bad input."""

import pytest
from jenga.policies import policy_for
from jenga.specs import Kind, KVGroup, LayerSpec, ModelSpec, SpecError


def test_page_bytes_per_kind():
    # 16 tokens x 2 (K, V) x 8 heads x 128 dim x 2 B = 65536
    assert LayerSpec(Kind.FULL, 8, 128).page_bytes == 65_536
    assert LayerSpec(Kind.SLIDING_WINDOW, 8, 128, window=4096).page_bytes == 65_536
    # one embedding vector per token: 16 x 1 x 3584 x 2 = 114688
    assert LayerSpec(Kind.VISION_EMBEDDING, 1, 3584).page_bytes == 114_688
    assert LayerSpec(Kind.MAMBA, state_bytes=573_440).page_bytes == 573_440
    assert LayerSpec(Kind.MAMBA, state_bytes=573_440).bytes_per_token == 0
    assert LayerSpec(Kind.FULL, 8, 128).num_kv_tensors == 2
    assert LayerSpec(Kind.VISION_EMBEDDING, 1, 64).num_kv_tensors == 1


def test_token_shards_keep_one_ranks_page():
    """A block of 64 tokens spread over 4 ranks: one rank's page holds 16 tokens' bytes."""
    sharded = LayerSpec(Kind.FULL, 8, 128, block_size=64, token_shards=4)
    assert sharded.page_bytes == LayerSpec(Kind.FULL, 8, 128).page_bytes == 65_536
    assert policy_for(sharded).num_blocks(65) == 2
    with pytest.raises(SpecError, match=r"divide block_size 64, got 3"):
        LayerSpec(Kind.FULL, 8, 128, block_size=64, token_shards=3)
    with pytest.raises(SpecError, match=r"a mamba state is not sharded by tokens \(2\)"):
        LayerSpec(Kind.MAMBA, state_bytes=1024, token_shards=2)


def test_token_fraction_rounds_up():
    spec = LayerSpec(Kind.FULL, 8, 128, token_fraction=(1, 4))
    assert [policy_for(spec).kept_tokens(n) for n in (0, 1, 4, 5, 1000)] == [0, 1, 1, 2, 250]
    assert policy_for(LayerSpec(Kind.FULL, 8, 128)).kept_tokens(1001) == 1001


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": Kind.FULL, "num_kv_heads": 0, "head_dim": 128}, "got 0 heads x 128"),
        ({"kind": Kind.FULL, "num_kv_heads": 8, "head_dim": 128, "block_size": 0}, "got 0"),
        ({"kind": Kind.SLIDING_WINDOW, "num_kv_heads": 8, "head_dim": 128}, "got None"),
        ({"kind": Kind.MAMBA, "state_bytes": -1}, "state_bytes > 0, got -1"),
        ({"kind": Kind.FULL, "num_kv_heads": 8, "head_dim": 128, "window": 4}, "window=4"),
        ({"kind": Kind.MAMBA, "state_bytes": 8, "chunk": 4}, "chunk=4 given for a mamba"),
        (
            {"kind": Kind.FULL, "num_kv_heads": 8, "head_dim": 1, "token_fraction": (3, 2)},
            "0 < num <= den, got 3/2",
        ),
        (
            {"kind": Kind.SLIDING_WINDOW, "num_kv_heads": 1, "head_dim": 1, "window": 8,
             "token_fraction": (1, 2)},
            "token_fraction 1/2 given for a sliding_window layer",
        ),
        (
            {"kind": Kind.CROSS_ATTENTION, "num_kv_heads": 1, "head_dim": 1,
             "tokens_per_image": 0},
            "tokens_per_image must be > 0, got 0",
        ),
        (
            {"kind": Kind.FULL, "num_kv_heads": 1, "head_dim": 1, "tokens_per_image": 5},
            "tokens_per_image=5 given for a full layer",
        ),
    ],
)  # fmt: skip
def test_bad_layer_specs(kwargs, message):
    with pytest.raises(SpecError, match=message):
        LayerSpec(**kwargs)


def test_cross_layer_sharing_counts_owners_only():
    spec = LayerSpec(Kind.SLIDING_WINDOW, 1, 128, window=1024)
    group = KVGroup("local", spec, (0, 3), readers=((1, 0), (2, 0), (4, 3)))
    assert group.num_layers == 2
    assert group.all_layer_ids == (0, 1, 2, 3, 4)
    model = ModelSpec("m", (group,), max_model_len=8192)
    assert (model.num_layers, model.num_model_layers) == (2, 5)


def test_bad_sharing_and_duplicate_layers():
    spec = LayerSpec(Kind.FULL, 1, 128)
    with pytest.raises(SpecError, match=r"layer 2 reads layer 5, which stores no cache"):
        KVGroup("g", spec, (0,), readers=((2, 5),))
    with pytest.raises(SpecError, match="layer 0 is listed as a reader twice or is also"):
        KVGroup("g", spec, (0,), readers=((0, 0),))
    with pytest.raises(SpecError, match=r"repeats a layer id: \(1, 1\)"):
        KVGroup("g", spec, (1, 1))
    a = KVGroup("a", spec, (0, 1))
    b = KVGroup("b", LayerSpec(Kind.SLIDING_WINDOW, 1, 128, window=8), (2,), readers=((1, 2),))
    with pytest.raises(SpecError, match="layer 1 of 'target' is in groups 'a' and 'b'"):
        ModelSpec("m", (a, b), max_model_len=64)


def test_draft_layers_may_reuse_layer_ids():
    target = KVGroup("target", LayerSpec(Kind.FULL, 8, 128), (0, 1))
    draft = KVGroup("draft", LayerSpec(Kind.FULL, 8, 64, model="draft"), (0, 1))
    model = ModelSpec("pair", (target, draft), max_model_len=64)
    assert model.models == ("target", "draft")
    assert model.num_layers == 4


def test_window_longer_than_the_model_is_rejected():
    spec = LayerSpec(Kind.SLIDING_WINDOW, 8, 128, window=4096)
    with pytest.raises(SpecError, match="window 4096 > max_model_len 2048"):
        ModelSpec("m", (KVGroup("swa", spec, (0,)),), max_model_len=2048)
