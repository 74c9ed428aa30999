"""The one place that knows how transformers releases differ (5.16 to 5.24).

Rationale
    The HF cache and the mini engine subclass transformers' cache layers and call its
    models, and the library renames and adds things between minor releases. Everything
    release-dependent is decided here, once, from what the installed release has (names,
    signatures), never from a version table elsewhere.

Approach
    ::

        DummyLayer                  transformers' (5.23+) or a local one of the same shape
        layer_types_and_kwargs      per-layer kwargs (5.23+) or one dict for all (5.16-5.22);
                                    both become a list of dicts, one per cache layer
        cache_kwargs(cache, fn)     {"cache": c} where `fn` takes ``cache=`` (generate and
                                    model forwards from 5.24), else {"past_key_values": c}
        cross_mask_from_zero()      Mllama's forward indexes ``cross_attention_mask`` by
                                    absolute position before 5.18 (it needs the rows from
                                    position 0); from 5.18 it takes the forward's rows

    Before 5.23 a KV-sharing model (Gemma 3n) has no cache layer for its reader layers:
    the layer list is cut at the first reader, as the library's own cache does; from 5.23
    on the readers are ``"dummy"`` layers. Either way the list mirrors the release's own.

Limitations
    `cache_kwargs` decides by signature: a model whose forward takes ``**kwargs`` only
    gets ``past_key_values``, which every release in range still accepts.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import transformers
from transformers import cache_utils

MIN_VERSION = (5, 16)  # the oldest release the HF cache and the mini engine are tested on


def version() -> tuple[int, ...]:
    """The installed transformers release as integers (``"5.17.0"`` -> ``(5, 17, 0)``)."""
    parts = []
    for part in transformers.__version__.split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def unsupported_reason() -> str | None:
    """Why the installed transformers cannot run the HF cache, or None when it can."""
    found = version()
    if found[:2] < MIN_VERSION:
        low = ".".join(map(str, MIN_VERSION))
        return f"transformers {transformers.__version__} is older than {low}"
    return None


class _LocalDummyLayer:
    """A cache layer that stores nothing (transformers' own `DummyLayer` from 5.23): a layer
    whose K/V another layer owns, or one without attention."""

    is_compileable = True
    is_croppable = True
    supports_early_init = False

    def __init__(self, **kwargs: Any) -> None:
        self.is_initialized = True
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor | None, value_states: torch.Tensor | None, *args: Any,
        **kwargs: Any,
    ) -> tuple[None, None]:  # fmt: skip
        if key_states is None and value_states is None:
            return None, None
        raise NotImplementedError("a dummy cache layer stores nothing and cannot be updated")

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1

    def _noop(self, *args: Any, **kwargs: Any) -> None:
        return None

    offload = prefetch = reset = crop = reorder_cache = _noop
    batch_repeat_interleave = batch_select_indices = _noop


DummyLayer: type = getattr(cache_utils, "DummyLayer", _LocalDummyLayer)


def layer_types_and_kwargs(text_config: Any) -> tuple[list[str], list[dict[str, Any]]]:
    """transformers' cache layer types of a decoder config and each layer's constructor
    kwargs, one dict per layer on every release."""
    types, kwargs = cache_utils.get_layer_types_and_kwargs(text_config)
    types = list(types)
    if isinstance(kwargs, dict):  # 5.16-5.22: one dict for every layer
        return types, [_kwargs_for(kind, kwargs) for kind in types]
    return types, [dict(k) for k in kwargs]


def _kwargs_for(kind: str, shared: dict[str, Any]) -> dict[str, Any]:
    """The keys of a release's shared kwargs dict that a layer of `kind` takes (as 5.23's
    per-layer lists give them)."""
    out: dict[str, Any] = {}
    if kind in ("sliding_attention", "hybrid_sliding", "chunked_attention"):
        out["sliding_window"] = shared["sliding_window"]
    if kind in ("heavily_compressed_attention", "compressed_sparse_attention"):
        out["config"] = shared["config"]
    if kind in ("conv", "linear_attention", "hybrid", "hybrid_sliding"):
        out["number_of_states"] = shared.get("number_of_states", 1)
    return out


def cross_mask_from_zero() -> bool:
    """Whether Mllama's forward wants ``cross_attention_mask`` rows from position 0 up to
    the last position of the forward (before 5.18: it picks ``past + arange(n)`` itself)
    rather than the forward's own rows."""
    return version()[:2] < (5, 18)


@functools.cache
def _takes_cache(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "cache" in params


def takes_cache_argument(fn: Callable[..., Any]) -> bool:
    """Whether `fn` (a model's `forward` or `generate`) takes the cache as ``cache=``.

    `generate` takes ``**kwargs``; it takes ``cache=`` where the release's
    `prepare_inputs_for_generation` does (5.24)."""
    func = getattr(fn, "__func__", fn)
    if getattr(func, "__name__", "") == "generate":
        from transformers.generation.utils import GenerationMixin

        return _takes_cache(GenerationMixin.prepare_inputs_for_generation)
    return _takes_cache(func)


def cache_kwargs(cache: Any, fn: Callable[..., Any] | None = None) -> dict[str, Any]:
    """The keyword that hands `cache` to `fn` (default: `generate`) on this release:
    ``model.generate(**inputs, **cache_kwargs(cache))``,
    ``model(ids, **cache_kwargs(cache, model.forward))``."""
    if fn is None:
        from transformers.generation.utils import GenerationMixin

        fn = GenerationMixin.generate
    return {"cache": cache} if takes_cache_argument(fn) else {"past_key_values": cache}
