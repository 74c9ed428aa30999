"""Prefix cache keys: chained block hashes over token ids plus extra keys.

Rationale
    A cached block may serve a new request only if everything that determined its
    contents is equal: every token before and in it, the images among those tokens, and
    the cache salt (tenant isolation). Chaining the hash (block i's hash covers block
    i-1's) makes one 64-bit key name a whole prefix, so each group's hash index answers
    "is block i of this prompt cached?" independently, which `possible_prefix` needs.

Approach
    - Root: ``hash_ints([salt, tokens_per_block])``; blocks of T tokens are hashed in C++
      (`jenga._core.hash_blocks`) continuing from the previous hash, so decode
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

import functools
from collections.abc import Sequence

import numpy as np

from jenga import _core

_MASK64 = (1 << 64) - 1
_INT64_MIN = -(1 << 63)


def _wrap_int64(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= (1 << 63) else value


@functools.lru_cache(maxsize=1024)
def root_hash(salt: int, tokens_per_block: int) -> int:
    """The chain's starting value for one salt and block size (memoized: one per request
    otherwise)."""
    return int(_core.hash_ints([_wrap_int64(salt), tokens_per_block], 0))


def effective_tokens(
    tokens: Sequence[int] | np.ndarray, start: int, images: Sequence[object] = ()
) -> np.ndarray:
    """A copy of ``tokens`` (positions ``start..``) with image spans replaced by image keys."""
    arr = np.array(tokens, dtype=np.int64)
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


class IntBuffer:
    """A growable 1-D integer array: amortized O(1) appends, slices are views (no copies).

    Holds a request's token ids (int64) and its block table per group (int32), so both
    reach the C++ core as buffers rather than one Python int per entry.
    """

    __slots__ = ("_buf", "size")

    def __init__(self, values: Sequence[int] | np.ndarray = (), dtype: type = np.int64) -> None:
        arr: np.ndarray = np.array(values, dtype=dtype) if len(values) else np.empty(0, dtype)
        self._buf = arr
        self.size = len(arr)

    @classmethod
    def adopt(cls, arr: np.ndarray) -> IntBuffer:
        """A buffer over ``arr`` itself, no copy: the caller hands ``arr`` over for good."""
        buf = cls.__new__(cls)
        buf._buf = arr
        buf.size = len(arr)
        return buf

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> int:
        if not 0 <= i < self.size:
            raise IndexError(f"index {i} out of range [0, {self.size})")
        return int(self._buf[i])

    def extend(self, values: Sequence[int] | np.ndarray) -> None:
        n = len(values)
        if self.size + n > len(self._buf):
            grown = np.empty(max(2 * len(self._buf), self.size + n, 16), dtype=self._buf.dtype)
            if self.size:
                grown[: self.size] = self._buf[: self.size]
            self._buf = grown
        self._buf[self.size : self.size + n] = values
        self.size += n

    def view(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        stop = self.size if stop is None else min(stop, self.size)
        return self._buf[start:stop]

    def tolist(self) -> list[int]:
        out: list[int] = self._buf[: self.size].tolist()
        return out


def TokenBuffer(tokens: Sequence[int] | np.ndarray) -> IntBuffer:
    """A request's token ids as an int64 `IntBuffer`."""
    return IntBuffer(tokens, np.int64)


class HashChain:
    """The block hashes of one token stream for one block size, extended as tokens come.

    Invariant: ``hashes[i]`` covers tokens ``[0, (i+1)*T)``; only complete blocks are hashed.
    """

    __slots__ = ("_buf", "_root", "count", "tokens_per_block")

    def __init__(self, salt: int, tokens_per_block: int) -> None:
        self.tokens_per_block = tokens_per_block
        self._root = root_hash(salt, tokens_per_block)
        self._buf = np.empty(0, dtype=np.uint64)
        self.count = 0

    @property
    def hashes(self) -> np.ndarray:
        return self._buf[: self.count]

    def extend(self, tokens: IntBuffer, num_tokens: int, images: Sequence[object]) -> None:
        """Hash the complete blocks within ``tokens[:num_tokens]`` not hashed yet."""
        t = self.tokens_per_block
        done = self.count * t
        target = (min(num_tokens, len(tokens)) // t) * t
        if target <= done:
            return
        arr = tokens.view(done, target)
        if images:
            arr = effective_tokens(arr, done, images)
        parent = int(self._buf[self.count - 1]) if self.count else self._root
        new = _core.hash_blocks(arr, t, parent)
        if self.count + len(new) > len(self._buf):
            grown = np.empty(max(2 * len(self._buf), self.count + len(new)), dtype=np.uint64)
            grown[: self.count] = self._buf[: self.count]
            self._buf = grown
        self._buf[self.count : self.count + len(new)] = new
        self.count += len(new)


def image_block_hashes(
    content_hash: int, num_blocks: int, tokens_per_block: int, salt: int
) -> list[int]:
    """Hashes of one image's blocks in an image group (independent of the text prefix)."""
    seed = _wrap_int64(salt) & _MASK64
    key = _wrap_int64(content_hash)
    return [int(_core.hash_ints([key, i, tokens_per_block], seed)) for i in range(num_blocks)]
