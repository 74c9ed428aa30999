"""Layer specs, KV groups and model specs: what one layer's cache looks like, in integers.

A `LayerSpec` says what a layer stores per token (or per request, for Mamba state) and
which tokens it must keep. Layers with equal specs form a `KVGroup`; a group shares one
block table per request. A `ModelSpec` is the list of groups plus what the simulator
needs to place the model on a GPU (weight bytes).

Sizes are bytes; `page_bytes` is the small page of the Jenga paper for one layer: the
bytes of one block (``block_size`` tokens, K and V) of one layer.
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class LayerSpec:
    """One layer's cache.

    Attention kinds store K and V: ``2 * num_kv_heads * head_dim * dtype_bytes`` per token.
    `MAMBA` stores `state_bytes` per request (conv + SSM state), independent of length.
    `VISION_EMBEDDING` stores ``num_kv_heads * head_dim * dtype_bytes`` per token (one
    embedding vector; heads x dim is its width).
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
    model: str = "target"  # which model of a draft+target pair this layer belongs to

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise SpecError(f"block_size must be > 0, got {self.block_size}")
        if self.dtype_bytes <= 0:
            raise SpecError(f"dtype_bytes must be > 0, got {self.dtype_bytes}")
        if self.kind is Kind.MAMBA:
            if self.state_bytes is None or self.state_bytes <= 0:
                raise SpecError(f"mamba layer needs state_bytes > 0, got {self.state_bytes}")
            if self.checkpoint_interval <= 0:
                raise SpecError(
                    f"mamba checkpoint_interval must be > 0, got {self.checkpoint_interval}"
                )
            return
        if self.num_kv_heads <= 0 or self.head_dim <= 0:
            raise SpecError(
                f"{self.kind} layer needs num_kv_heads > 0 and head_dim > 0, "
                f"got {self.num_kv_heads} heads x {self.head_dim}"
            )
        if self.kind is Kind.SLIDING_WINDOW and (self.window is None or self.window <= 0):
            raise SpecError(f"sliding_window layer needs window > 0, got {self.window}")
        if self.kind is Kind.CHUNKED_LOCAL and (self.chunk is None or self.chunk <= 0):
            raise SpecError(f"chunked_local layer needs chunk > 0, got {self.chunk}")

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token adds to this layer's cache (0 for Mamba: its state is fixed)."""
        if self.kind is Kind.MAMBA:
            return 0
        width = self.num_kv_heads * self.head_dim * self.dtype_bytes
        return width if self.kind is Kind.VISION_EMBEDDING else 2 * width

    @property
    def page_bytes(self) -> int:
        """The small page: one block of this layer (one state for Mamba)."""
        if self.kind is Kind.MAMBA:
            assert self.state_bytes is not None
            return self.state_bytes
        return self.bytes_per_token * self.block_size


@dataclass(frozen=True)
class KVGroup:
    """Layers with equal specs; they share one block table per request."""

    name: str
    spec: LayerSpec
    layer_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.layer_ids:
            raise SpecError(f"group {self.name!r} has no layers")

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)


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
        for g in self.groups:
            w = g.spec.window
            if g.spec.kind is Kind.SLIDING_WINDOW and w is not None and w > self.max_model_len:
                raise SpecError(
                    f"group {g.name!r}: window {w} > max_model_len {self.max_model_len}"
                )

    @property
    def num_layers(self) -> int:
        return sum(g.num_layers for g in self.groups)

    def group(self, name: str) -> KVGroup:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(
            f"model {self.name!r} has no group {name!r}; groups: {[g.name for g in self.groups]}"
        )
