"""Recurrent (linear-attention) layer states from a Hugging Face config, in integers.

Rationale
    A Mamba or gated delta-net layer keeps no per-token K/V: a request carries a fixed
    state (a rolling window of convolution inputs plus a recurrent matrix), and its size
    is what jenga's `MAMBA` kind stores per request. Three state shapes cover the families
    served today; each is recognised by the config fields it has, not by `model_type`, so
    a new model of a known architecture needs no code.

Approach
    ::

        family           fields that name it          conv channels            recurrent
        Mamba (Jamba)    mamba_d_state, no heads      d_inner                  [d_inner, d_state]
        Mamba2 (Bamba,   mamba_n_heads / n_mamba_     d_inner + 2*groups*      [heads, head_dim,
         Falcon-H1,       heads                       d_state                   d_state]
         Zamba2)
        gated delta-net  linear_key_head_dim          2*kh*kd + vh*vd          [vh, kd, vd]
         (Qwen3-Next)

    ``d_inner = mamba_expand * hidden_size`` (Falcon-H1: ``mamba_d_ssm`` when set). The
    conv state keeps ``kernel - 1`` past inputs in a serving engine (vLLM) and the whole
    ``kernel`` columns in transformers' cache (`LinearState.num_bytes(full_kernel=True)`).

Limitations
    One conv and one recurrent state per layer (transformers' ``number_of_conv_states``
    > 1 is refused by the caller). Shapes only; the arithmetic of each family is the
    library's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from jenga.specs import SpecError

Config = Mapping[str, Any]
STATE_ALIGN = 16  # the recurrent state starts at a 16-byte boundary after the conv state


@dataclass(frozen=True)
class LinearState:
    """One request's state in one layer: conv ``[channels, kernel]`` + recurrent shape."""

    family: str
    conv_channels: int
    conv_kernel: int
    recurrent: tuple[int, ...]

    def __post_init__(self) -> None:
        if min(self.conv_channels, self.conv_kernel, *self.recurrent) <= 0:
            raise SpecError(f"{self.family} state has a non-positive size: {self}")

    def num_bytes(self, dtype_bytes: int, ssm_dtype_bytes: int, *, full_kernel: bool) -> int:
        """Conv (model dtype) then recurrent (SSM dtype), each padded to 16 bytes."""
        columns = self.conv_kernel if full_kernel else self.conv_kernel - 1
        conv = _align(self.conv_channels * columns * dtype_bytes)
        return conv + _align(math.prod(self.recurrent) * ssm_dtype_bytes)


def _align(n: int) -> int:
    return -(-n // STATE_ALIGN) * STATE_ALIGN


def _int(config: Config, key: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise SpecError(f"config field {key!r} must be an int, got {value!r}")
    return value


def _first(config: Config, *keys: str) -> int:
    for key in keys:
        if config.get(key) is not None:
            return _int(config, key)
    raise SpecError(f"config has none of the fields {list(keys)}")


def _mamba_inner(config: Config) -> int:
    if config.get("mamba_d_ssm") is not None:
        return _int(config, "mamba_d_ssm")
    expand = config.get("mamba_expand")
    if not isinstance(expand, int | float) or expand <= 0:
        raise SpecError(f"config field 'mamba_expand' must be > 0, got {expand!r}")
    return int(expand * _int(config, "hidden_size"))


def linear_state(config: Config) -> LinearState:
    """The state shape of the config's linear-attention layers (see module note).

    Raises `SpecError` naming the fields when the config matches no known family."""
    if config.get("linear_key_head_dim") is not None:
        key_heads, key_dim = (
            _int(config, "linear_num_key_heads"),
            _int(config, "linear_key_head_dim"),
        )
        value_heads = _int(config, "linear_num_value_heads")
        value_dim = _int(config, "linear_value_head_dim")
        return LinearState(
            "gated_delta_net",
            2 * key_heads * key_dim + value_heads * value_dim,
            _int(config, "linear_conv_kernel_dim"),
            (value_heads, key_dim, value_dim),
        )
    if config.get("mamba_n_heads") is not None or config.get("n_mamba_heads") is not None:
        heads = _first(config, "mamba_n_heads", "n_mamba_heads")
        d_inner = _mamba_inner(config)
        head_dim = config.get("mamba_d_head", config.get("mamba_headdim"))
        head_dim = d_inner // heads if head_dim in (None, "auto") else int(head_dim)
        d_state = _int(config, "mamba_d_state")
        groups = _first(config, "mamba_n_groups", "mamba_ngroups")
        return LinearState(
            "mamba2",
            d_inner + 2 * groups * d_state,
            _int(config, "mamba_d_conv"),
            (heads, head_dim, d_state),
        )
    if config.get("mamba_d_state") is not None:
        d_inner = _mamba_inner(config)
        return LinearState(
            "mamba", d_inner, _int(config, "mamba_d_conv"), (d_inner, _int(config, "mamba_d_state"))
        )
    raise SpecError(
        "linear-attention layers but no known state fields (linear_key_head_dim: gated "
        "delta-net; mamba_n_heads / n_mamba_heads: Mamba2; mamba_d_state: Mamba)"
    )
