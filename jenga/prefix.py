"""Prefix cache keys: chained block hashes over token ids plus extra keys.

Rationale
    A cached block may serve a new request only if everything that determined its
    contents is equal: every token before and in it, the images among those tokens, and
    the cache salt (tenant isolation). Chaining the hash (block i's hash covers block
    i-1's) makes one 64-bit key name a whole prefix, so each group's hash index answers
    "is block i of this prompt cached?" independently, which `possible_prefix` needs.

Approach
    - Root: ``hash_ints([salt, tokens_per_block])``; blocks of T tokens are hashed in C++
      (`vmm._core.jenga.hash_blocks`) continuing from the previous hash, so decode
      extends a chain incrementally.
    - Images: the prompt's placeholder tokens inside an image span are replaced by
      ``content_hash + offset`` before hashing, so the same placeholders with another
      image give other hashes.
    - Image groups (cross attention, vision embeddings) hash per image:
      ``hash_ints([content_hash, block_in_image, T], salt)``; their contents depend on
      the image alone, so two prompts with one image share those blocks.

Limitations
    64-bit keys: a collision aliases two prefixes (expected first collision after ~4e9
    distinct blocks). Token ids must fit in int64.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from vmm._core import jenga as _core

_MASK64 = (1 << 64) - 1
_INT64_MIN = -(1 << 63)


def _wrap_int64(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= (1 << 63) else value


def root_hash(salt: int, tokens_per_block: int) -> int:
    """The chain's starting value for one salt and block size."""
    return int(_core.hash_ints([_wrap_int64(salt), tokens_per_block], 0))


def effective_tokens(
    tokens: Sequence[int], start: int, images: Sequence[object] = ()
) -> np.ndarray:
    """``tokens`` (positions ``start..``) as int64 with image spans replaced by image keys."""
    arr = np.asarray(tokens, dtype=np.int64)
    stop = start + len(arr)
    for image in images:
        lo = max(start, image.start)  # type: ignore[attr-defined]
        hi = min(stop, image.end)  # type: ignore[attr-defined]
        if lo >= hi:
            continue
        base = _wrap_int64(image.content_hash)  # type: ignore[attr-defined]
        offsets = np.arange(lo - image.start, hi - image.start, dtype=np.int64)  # type: ignore[attr-defined]
        with np.errstate(over="ignore"):
            arr[lo - start : hi - start] = np.int64(base) + offsets
    return arr


class HashChain:
    """The block hashes of one token stream for one block size, extended as tokens come.

    Invariant: ``hashes[i]`` covers tokens ``[0, (i+1)*T)``; only complete blocks are hashed.
    """

    __slots__ = ("_root", "hashes", "tokens_per_block")

    def __init__(self, salt: int, tokens_per_block: int) -> None:
        self.tokens_per_block = tokens_per_block
        self._root = root_hash(salt, tokens_per_block)
        self.hashes: list[int] = []

    def extend(self, tokens: Sequence[int], num_tokens: int, images: Sequence[object]) -> None:
        """Hash the complete blocks within ``tokens[:num_tokens]`` not hashed yet."""
        t = self.tokens_per_block
        done = len(self.hashes) * t
        target = (min(num_tokens, len(tokens)) // t) * t
        if target <= done:
            return
        arr = effective_tokens(tokens[done:target], done, images)
        parent = self.hashes[-1] if self.hashes else self._root
        self.hashes.extend(_core.hash_blocks(arr, t, parent))


def image_block_hashes(
    content_hash: int, num_blocks: int, tokens_per_block: int, salt: int
) -> list[int]:
    """Hashes of one image's blocks in an image group (independent of the text prefix)."""
    seed = _wrap_int64(salt) & _MASK64
    key = _wrap_int64(content_hash)
    return [int(_core.hash_ints([key, i, tokens_per_block], seed)) for i in range(num_blocks)]
