"""Layer specs, KV groups and model specs: what one layer's cache looks like, in integers.

Rationale: the allocator, page math, simulator and engines all need the same description
of a model's caches, and `jenga` must stay torch-free; frozen dataclasses of ints are
hashable (equal specs group themselves) and cheap to validate once at construction.

Approach: a `LayerSpec` says what a layer stores per token (or per request, for Mamba state) and
which tokens it must keep. Layers with equal specs form a `KVGroup`; a group shares one
block table per request. A `ModelSpec` is the list of groups plus what the simulator
needs to place the model on a GPU (weight bytes).

Sizes are bytes; `page_bytes` is the small page of the Jenga paper for one layer: the
bytes of one block (``block_size`` tokens, K and V) of one layer.

Two model features beyond "one cache per layer" are expressed here, in integers:

- cross-layer KV sharing (character.ai, Hymba): a group's `readers` are layers that attend
  over another layer's cache and store none of their own, so they cost no memory and own
  no virtual range;
- per-layer token budgets (PyramidKV-style): `LayerSpec.token_fraction = (num, den)` keeps
  ``ceil(length * num / den)`` of a request's tokens in that layer.

Draft and target models of a speculative-decoding pair share one ModelSpec; their layers
differ by `LayerSpec.model`, so they always fall into different groups. A parallel hybrid
(Hymba) may list one layer id in an attention group and in a Mamba group.

Limitations: one dtype per layer (K and V alike); per-head or per-layer head-count
variation inside one group is not expressible (such layers become separate groups).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum


class SpecError(ValueError):
    """A layer or model spec is malformed (non-positive size, window > max length, ...)."""


class Kind(StrEnum):
    FULL = "full"
    SLIDING_WINDOW = "sliding_window"
    CHUNKED_LOCAL = "chunked_local"
    MAMBA = "mamba"
    CROSS_ATTENTION = "cross_attention"
    VISION_EMBEDDING = "vision_embedding"
    MLA = "mla"  # multi-head latent attention (DeepSeek-V2/V3): one latent vector per token
    SLIDING_WINDOW_MLA = "sliding_window_mla"  # MLA latents read over a sliding window
    SINK_FULL = "sink_full"  # full attention behind `sink_len` engine-held sink tokens
    # sliding-window MLA never cached: a prefix hit recomputes the hit's last window
    REPLAY_SLIDING_WINDOW_MLA = "replay_sliding_window_mla"
    # one block per request, a ring of the last `block_size` rows; never cached
    CIRCULAR_BUFFER = "circular_buffer"
    # MLA with one stored state per `tokens_per_state` tokens (DeepSeek-V4 compressed MLA)
    COMPRESSED_MLA = "compressed_mla"


# kinds that slide a window over the tokens (`LayerSpec.window` required)
WINDOW_KINDS = frozenset(
    {Kind.SLIDING_WINDOW, Kind.SLIDING_WINDOW_MLA, Kind.REPLAY_SLIDING_WINDOW_MLA}
)
# kinds that store one vector per token, not a K and a V (one tensor per layer)
ONE_VECTOR_KINDS = frozenset(
    {
        Kind.VISION_EMBEDDING,
        Kind.MLA,
        Kind.SLIDING_WINDOW_MLA,
        Kind.REPLAY_SLIDING_WINDOW_MLA,
        Kind.CIRCULAR_BUFFER,
        Kind.COMPRESSED_MLA,
    }
)


@dataclass(frozen=True)
class LayerSpec:
    """One layer's cache.

    Attention kinds store K and V: ``2 * num_kv_heads * head_dim * dtype_bytes`` per token.
    `MAMBA` stores `state_bytes` per request (conv + SSM state), independent of length.
    `VISION_EMBEDDING` stores ``num_kv_heads * head_dim * dtype_bytes`` per token (one
    embedding vector; heads x dim is its width), and so do the MLA kinds (one compressed
    latent per token, read as both K and V; ``head_dim`` is the latent width with its rope
    part, e.g. DeepSeek-V3's 512 + 64; `REPLAY_SLIDING_WINDOW_MLA` too). `SINK_FULL`
    layers keep full attention's per-token cache; their `sink_len` sink tokens are the
    engine's, written once outside any request's blocks. A `CIRCULAR_BUFFER` layer holds
    one block of ``block_size`` rows of ``num_kv_heads * head_dim * dtype_bytes`` per
    request (a ring the engine overwrites), whatever the request's length. A
    `COMPRESSED_MLA` layer stores one ``num_kv_heads * head_dim * dtype_bytes`` state per
    `tokens_per_state` tokens (a divisor of ``block_size``): its page is
    ``block_size // tokens_per_state`` states, its `bytes_per_token` a rounded-up average.
    """

    kind: Kind
    num_kv_heads: int = 0
    head_dim: int = 0
    dtype_bytes: int = 2
    block_size: int = 16
    window: int | None = None  # SLIDING_WINDOW: tokens attended, including the current one
    chunk: int | None = None  # CHUNKED_LOCAL: attention chunk length (Llama 4: 8192)
    state_bytes: int | None = None  # MAMBA: bytes of one request's state in one layer
    checkpoint_interval: int = 512  # MAMBA: cache a state every N tokens for prefix hits
    # MAMBA: states a request keeps past its running one, one per draft token of
    # speculative decoding (vLLM's ``MambaSpec.num_speculative_blocks``)
    speculative_states: int = 0
    model: str = "target"  # which model of a draft+target pair this layer belongs to
    # FULL only: (num, den) share of a request's tokens this layer keeps (PyramidKV-style).
    token_fraction: tuple[int, int] = (1, 1)
    # CROSS_ATTENTION / VISION_EMBEDDING: tokens one image contributes (mllama: 4 tiles x 1601).
    tokens_per_image: int | None = None
    sink_len: int | None = None  # SINK_FULL: sink tokens, a multiple of block_size
    # attention kinds: ranks a block's tokens are spread over (vLLM's decode context
    # parallelism); one rank's page holds block_size // token_shards of them
    token_shards: int = 1
    tokens_per_state: int = 1  # COMPRESSED_MLA: tokens one stored state covers (> 1)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise SpecError(f"block_size must be > 0, got {self.block_size}")
        if self.token_shards <= 0 or self.block_size % self.token_shards:
            raise SpecError(
                f"token_shards must be > 0 and divide block_size {self.block_size}, "
                f"got {self.token_shards}"
            )
        if self.dtype_bytes <= 0:
            raise SpecError(f"dtype_bytes must be > 0, got {self.dtype_bytes}")
        self._check_kind_fields()
        if self.kind is Kind.MAMBA:
            if self.state_bytes is None or self.state_bytes <= 0:
                raise SpecError(f"mamba layer needs state_bytes > 0, got {self.state_bytes}")
            if self.checkpoint_interval <= 0:
                raise SpecError(
                    f"mamba checkpoint_interval must be > 0, got {self.checkpoint_interval}"
                )
            if self.token_shards != 1:
                raise SpecError(f"a mamba state is not sharded by tokens ({self.token_shards})")
            if self.speculative_states < 0:
                raise SpecError(
                    f"mamba speculative_states must be >= 0, got {self.speculative_states}"
                )
            return
        if self.num_kv_heads <= 0 or self.head_dim <= 0:
            raise SpecError(
                f"{self.kind} layer needs num_kv_heads > 0 and head_dim > 0, "
                f"got {self.num_kv_heads} heads x {self.head_dim}"
            )
        if self.kind in WINDOW_KINDS and (self.window is None or self.window <= 0):
            raise SpecError(f"{self.kind} layer needs window > 0, got {self.window}")
        if self.kind is Kind.CHUNKED_LOCAL and (self.chunk is None or self.chunk <= 0):
            raise SpecError(f"chunked_local layer needs chunk > 0, got {self.chunk}")

    def _check_kind_fields(self) -> None:
        """Fields that belong to one kind must not be set on another (a typo guard)."""
        if self.window is not None and self.kind not in WINDOW_KINDS:
            raise SpecError(f"window={self.window} given for a {self.kind} layer")
        if self.kind is Kind.SINK_FULL:
            sink = self.sink_len
            if sink is None or sink <= 0 or sink % self.block_size:
                raise SpecError(
                    f"sink_full layer needs sink_len > 0 and a multiple of block_size "
                    f"{self.block_size}, got {sink}"
                )
        elif self.sink_len is not None:
            raise SpecError(f"sink_len={self.sink_len} given for a {self.kind} layer")
        self._check_tokens_per_state()
        if self.chunk is not None and self.kind is not Kind.CHUNKED_LOCAL:
            raise SpecError(f"chunk={self.chunk} given for a {self.kind} layer")
        if self.state_bytes is not None and self.kind is not Kind.MAMBA:
            raise SpecError(f"state_bytes={self.state_bytes} given for a {self.kind} layer")
        if self.speculative_states and self.kind is not Kind.MAMBA:
            raise SpecError(
                f"speculative_states={self.speculative_states} given for a {self.kind} layer"
            )
        num, den = self.token_fraction
        if (num, den) != (1, 1):
            if self.kind is not Kind.FULL:
                raise SpecError(f"token_fraction {num}/{den} given for a {self.kind} layer")
            if not 0 < num <= den:
                raise SpecError(f"token_fraction must satisfy 0 < num <= den, got {num}/{den}")
        image_kinds = (Kind.CROSS_ATTENTION, Kind.VISION_EMBEDDING)
        if self.tokens_per_image is not None:
            if self.kind not in image_kinds:
                raise SpecError(
                    f"tokens_per_image={self.tokens_per_image} given for a {self.kind} layer"
                )
            if self.tokens_per_image <= 0:
                raise SpecError(f"tokens_per_image must be > 0, got {self.tokens_per_image}")

    def _check_tokens_per_state(self) -> None:
        tps = self.tokens_per_state
        if self.kind is not Kind.COMPRESSED_MLA:
            if tps != 1:
                raise SpecError(f"tokens_per_state={tps} given for a {self.kind} layer")
        elif tps <= 1 or self.block_size % tps:
            raise SpecError(
                f"compressed_mla layer needs tokens_per_state > 1 dividing block_size "
                f"{self.block_size}, got {tps}"
            )

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token adds to this layer's cache (0 for Mamba: its state is fixed)."""
        if self.kind is Kind.MAMBA:
            return 0
        width = self.num_kv_heads * self.head_dim * self.dtype_bytes
        if self.kind is Kind.COMPRESSED_MLA:  # an average: one state per tokens_per_state
            return -(-width // self.tokens_per_state)
        return width if self.kind in ONE_VECTOR_KINDS else 2 * width

    @property
    def num_kv_tensors(self) -> int:
        """2 for K/V attention kinds (which a layout may put in separate ranges), else 1."""
        return 1 if self.kind is Kind.MAMBA or self.kind in ONE_VECTOR_KINDS else 2

    @property
    def page_bytes(self) -> int:
        """The small page: one block of this layer (one state for Mamba); with
        `token_shards` > 1, the part of the block one rank holds."""
        if self.kind is Kind.MAMBA:
            assert self.state_bytes is not None
            return self.state_bytes
        tokens = self.block_size // self.token_shards  # one rank's share of a block
        if self.kind is Kind.COMPRESSED_MLA:
            states = tokens // self.tokens_per_state
            return states * self.num_kv_heads * self.head_dim * self.dtype_bytes
        return self.bytes_per_token * tokens


@dataclass(frozen=True)
class KVGroup:
    """Layers with equal specs; they share one block table per request.

    Invariants: `layer_ids` (the layers that store a cache) are distinct and non-empty;
    every reader ``(layer, owner)`` names an owner in `layer_ids` and a layer that is not
    itself an owner; a reader appears once. Memory is counted over `layer_ids` only.
    """

    name: str
    spec: LayerSpec
    layer_ids: tuple[int, ...]
    readers: tuple[tuple[int, int], ...] = ()  # (layer, owner): layer reads owner's cache

    def __post_init__(self) -> None:
        if not self.layer_ids:
            raise SpecError(f"group {self.name!r} has no layers")
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise SpecError(f"group {self.name!r} repeats a layer id: {self.layer_ids}")
        owners = set(self.layer_ids)
        seen: set[int] = set()
        for layer, owner in self.readers:
            if owner not in owners:
                raise SpecError(
                    f"group {self.name!r}: layer {layer} reads layer {owner}, "
                    f"which stores no cache in this group (owners {sorted(owners)})"
                )
            if layer in owners or layer in seen:
                raise SpecError(
                    f"group {self.name!r}: layer {layer} is listed as a reader twice "
                    "or is also an owner"
                )
            seen.add(layer)

    @property
    def num_layers(self) -> int:
        """Layers that store a cache (owners); readers cost nothing."""
        return len(self.layer_ids)

    @property
    def all_layer_ids(self) -> tuple[int, ...]:
        """Owners and readers, sorted: every model layer this group serves."""
        return tuple(sorted((*self.layer_ids, *(layer for layer, _ in self.readers))))


@dataclass(frozen=True)
class ModelSpec:
    """A model's KV groups plus its placement facts."""

    name: str
    groups: tuple[KVGroup, ...]
    max_model_len: int
    weight_bytes: int = 0
    extra: dict[str, int] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not self.groups:
            raise SpecError(f"model {self.name!r} has no KV groups")
        if self.max_model_len <= 0:
            raise SpecError(f"max_model_len must be > 0, got {self.max_model_len}")
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise SpecError(f"model {self.name!r} has duplicate group names: {names}")
        self._check_layer_ids_unique()
        for g in self.groups:
            w = g.spec.window
            if g.spec.kind is Kind.SLIDING_WINDOW and w is not None and w > self.max_model_len:
                raise SpecError(
                    f"group {g.name!r}: window {w} > max_model_len {self.max_model_len}"
                )

    def _check_layer_ids_unique(self) -> None:
        """A (model, layer id) pair is in one attention-kind group and at most one Mamba
        group (a parallel hybrid such as Hymba runs attention and Mamba heads in one layer)."""
        seen: dict[tuple[str, int, bool], str] = {}
        for g in self.groups:
            for layer in g.all_layer_ids:
                key = (g.spec.model, layer, g.spec.kind is Kind.MAMBA)
                if key in seen:
                    raise SpecError(
                        f"model {self.name!r}: layer {layer} of {g.spec.model!r} is in "
                        f"groups {seen[key]!r} and {g.name!r}"
                    )
                seen[key] = g.name

    @property
    def num_layers(self) -> int:
        """Layers that store a cache, over all groups (readers of shared KV excluded)."""
        return sum(g.num_layers for g in self.groups)

    @property
    def num_model_layers(self) -> int:
        """Every layer the groups serve, readers of shared KV included."""
        return sum(len(g.all_layer_ids) for g in self.groups)

    @property
    def models(self) -> tuple[str, ...]:
        """The model names in group order, each once ("target", then e.g. "draft")."""
        return tuple(dict.fromkeys(g.spec.model for g in self.groups))

    def group(self, name: str) -> KVGroup:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(
            f"model {self.name!r} has no group {name!r}; groups: {[g.name for g in self.groups]}"
        )

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token adds over all cache-storing layers if every layer kept it."""
        return sum(g.num_layers * g.spec.bytes_per_token for g in self.groups)


def default_group_name(spec: LayerSpec) -> str:
    """`kind`, prefixed by a non-target model and suffixed by a token fraction.

    Examples: ``full``, ``sliding_window``, ``draft.full``, ``full@1/4``.
    """
    name = str(spec.kind)
    if spec.model != "target":
        name = f"{spec.model}.{name}"
    if spec.token_fraction != (1, 1):
        name += "@{}/{}".format(*spec.token_fraction)
    return name


def group_layers(layer_specs: Sequence[tuple[int, LayerSpec]]) -> tuple[KVGroup, ...]:
    """Group ``(layer id, spec)`` pairs by equal spec, in order of first appearance.

    Names come from `default_group_name`; a second distinct spec with the same name gets
    ``#2``, ``#3``, ... appended.
    """
    spec_to_layers: dict[LayerSpec, list[int]] = {}
    for layer, spec in layer_specs:
        spec_to_layers.setdefault(spec, []).append(layer)
    groups: list[KVGroup] = []
    name_counts: dict[str, int] = {}
    for spec, layers in spec_to_layers.items():
        base = default_group_name(spec)
        name_counts[base] = name_counts.get(base, 0) + 1
        name = base if name_counts[base] == 1 else f"{base}#{name_counts[base]}"
        groups.append(KVGroup(name, spec, tuple(layers)))
    return tuple(groups)
