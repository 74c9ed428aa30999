"""Prefix cache keys: chained 128-bit block identities over token ids plus extra keys.

Rationale
    A cached block may serve a new request only if everything that determined its
    contents is equal: every token before and in it, the images among those tokens, and
    the cache salt (tenant isolation). Chaining the identity (block i's covers block
    i-1's) makes one key name a whole prefix, so each group's index answers "is block i
    of this prompt cached?" independently, which `possible_prefix` needs. A wrong hit
    serves one request another's KV, so the identity is 128 bits of a keyed or
    cryptographic digest (`BlockIdentity`): no one can pick prompts that collide.

Approach
    - `jenga._core.BlockHasher` (csrc/jenga/digest.hpp): keyed BLAKE2b-128 by default,
      SHA-256 / HMAC-SHA-256 cut to 128 bits on request. An identity is two uint64 words;
      a run of them is a ``(n, 2)`` uint64 array.
    - Root: the digest of ``"jenga.root"``, the salt and the block size. Blocks of T tokens
      are chained in C++ (`BlockHasher.chain`) from the previous identity, so decode
      extends a chain incrementally.
    - Images: a block that holds positions of an image is hashed on its own with extra
      bytes naming each such image (its whole ``content_hash``, the overlap's offset in
      the image and in the block), so the same placeholders with another image give
      other identities, and an image key is never cut to 64 bits.
    - Image groups (cross attention, vision embeddings) key per image: the digest of
      ``"jenga.image"``, the content hash, the block's index in the image, T and the
      salt; their contents depend on the image alone, so two prompts with one image
      share those blocks.
    Integers enter messages length-prefixed and signed (`_int_bytes`), so any size works
    and no two lists encode alike.

Limitations
    The core's index keys an identity by 64 of its bits; it compares the whole identity
    on every hit (`jenga.allocator`), so a short-key collision costs a hit, never
    correctness. Token ids must fit in int64.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jenga import _core
from jenga.errors import InvalidInput

#: Algorithms `BlockIdentity` accepts.
HASH_ALGORITHMS = ("blake2b", "sha256")


@dataclass(frozen=True)
class BlockIdentity:
    """How an allocator names blocks: the digest, its key, and the index's short key.

    ``algorithm``: ``"blake2b"`` (BLAKE2b with a 128-bit digest, keyed) or ``"sha256"``
    (SHA-256, HMAC-SHA-256 when keyed; its first 128 bits). ``key``: None draws 32 random
    bytes per allocator (nobody outside the process can aim at a collision; identities
    then differ between processes); ``b""`` hashes without a key (identities are the same
    in every process); other bytes key the digest (BLAKE2b: at most 64). ``short_key_bits``
    (64): bits of the identity the core's hash index keys by; fewer is a test hook that
    makes short-key collisions common (they are detected and never served either way).
    ``digest_block_size`` (None): when set to H, text blocks are named by the caller's
    own chained digests, one per H tokens (``digests=`` of `JengaAllocator.add_request`,
    `prefix_match`, `cache`; an engine such as vLLM that hashes blocks already): a block
    of ``t = m * H`` tokens takes the first 128 bits of the digest of its last H-block,
    which chains over everything before (`digest_identities`). The allocator then hashes
    no token and keeps no token ids (`TokenCount`); image groups still use
    ``algorithm`` and ``key``.
    """

    algorithm: str = "blake2b"
    key: bytes | None = None
    short_key_bits: int = 64
    digest_block_size: int | None = None

    def __post_init__(self) -> None:
        if self.algorithm not in HASH_ALGORITHMS:
            raise InvalidInput(
                f"identity algorithm {self.algorithm!r} is not one of {HASH_ALGORITHMS}"
            )
        if self.key is not None and not isinstance(self.key, bytes):
            raise InvalidInput(f"identity key must be bytes or None, got {type(self.key).__name__}")
        if self.algorithm == "blake2b" and self.key is not None and len(self.key) > 64:
            raise InvalidInput(f"a blake2b key has at most 64 bytes, got {len(self.key)}")
        size = self.digest_block_size
        if size is not None and (type(size) is not int or size <= 0):
            raise InvalidInput(f"digest_block_size must be a positive int or None, got {size!r}")
        bits = self.short_key_bits
        if type(bits) is not int or not 0 <= bits <= 64:
            raise InvalidInput(f"short_key_bits must be an int in [0, 64], got {bits!r}")

    def hasher(self) -> _core.BlockHasher:
        """A hasher with this algorithm and key (a fresh random key when ``key`` is None)."""
        key = os.urandom(32) if self.key is None else self.key
        return _core.BlockHasher(self.algorithm, key)


def _int_bytes(value: int) -> bytes:
    """``value`` as a 4-byte length and its signed little-endian bytes."""
    size = value.bit_length() // 8 + 1
    return size.to_bytes(4, "little") + value.to_bytes(size, "little", signed=True)


def content_hash(values: Sequence[int] | np.ndarray) -> int:
    """A 128-bit `ImageSpan.content_hash` for content given as integers (BLAKE2b-128 of
    their int64 bytes, unkeyed: the same in every process)."""
    data = np.asarray(values, dtype=np.int64).astype("<i8").tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=16).digest(), "little")


def no_identities() -> np.ndarray:
    """An empty run of identities, shape ``(0, 2)``."""
    return np.empty((0, 2), dtype=np.uint64)


def root_hash(hasher: _core.BlockHasher, salt: int, tokens_per_block: int) -> np.ndarray:
    """The chain's starting identity for one salt and block size."""
    return hasher.digest(b"jenga.root\0" + _int_bytes(salt) + _int_bytes(tokens_per_block))


def _image_extra(images: Sequence[object], lo: int, hi: int) -> bytes:
    """Extra bytes of the block over positions ``[lo, hi)``: every image it overlaps."""
    parts = []
    for image in images:
        start, end = image.start, image.end  # type: ignore[attr-defined]
        a, b = max(lo, start), min(hi, end)
        if a < b:
            key = _int_bytes(image.content_hash)  # type: ignore[attr-defined]
            parts.append(
                b"I" + key + _int_bytes(a - start) + _int_bytes(a - lo) + _int_bytes(b - a)
            )
    return b"".join(parts)


def _image_blocks(images: Sequence[object], first: int, stop: int, t: int) -> list[int]:
    """Indices in ``[first, stop)`` of the T-token blocks that overlap an image."""
    out: set[int] = set()
    for image in images:
        lo = max(first, image.start // t)  # type: ignore[attr-defined]
        hi = min(stop, (image.end - 1) // t + 1)  # type: ignore[attr-defined]
        out.update(range(lo, hi))
    return sorted(out)


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
    """The identities of one token stream for one block size, extended as tokens come.

    Invariant: ``hashes[i]`` (two uint64 words) covers tokens ``[0, (i+1)*T)`` and the
    images among them; only complete blocks are hashed.
    """

    __slots__ = ("_buf", "_hasher", "_root", "count", "tokens_per_block")

    def __init__(self, hasher: _core.BlockHasher, salt: int, tokens_per_block: int) -> None:
        self.tokens_per_block = tokens_per_block
        self._hasher = hasher
        self._root = root_hash(hasher, salt, tokens_per_block)
        self._buf = no_identities()
        self.count = 0

    @property
    def hashes(self) -> np.ndarray:
        return self._buf[: self.count]

    def copy(self) -> HashChain:
        """An independent chain with the same identities (a forked request's)."""
        out = HashChain.__new__(HashChain)
        out.tokens_per_block, out._hasher = self.tokens_per_block, self._hasher
        out._root = self._root
        out._buf, out.count = self._buf[: self.count].copy(), self.count
        return out

    def extend(self, tokens: IntBuffer, num_tokens: int, images: Sequence[object]) -> None:
        """Hash the complete blocks within ``tokens[:num_tokens]`` not hashed yet."""
        t = self.tokens_per_block
        first = self.count
        stop = min(num_tokens, len(tokens)) // t
        if stop <= first:
            return
        parent = self._buf[first - 1] if first else self._root
        arr = tokens.view(first * t, stop * t)
        if images:
            new = self._chain_with_images(arr, first, stop, parent, images)
        else:
            new = self._hasher.chain(arr, t, parent)
        if stop > len(self._buf):
            grown = np.empty((max(2 * len(self._buf), stop), 2), dtype=np.uint64)
            grown[:first] = self._buf[:first]
            self._buf = grown
        self._buf[first:stop] = new
        self.count = stop

    def _chain_with_images(
        self, arr: np.ndarray, first: int, stop: int, parent: np.ndarray, images: Sequence[object]
    ) -> np.ndarray:
        """Blocks ``first..stop`` (tokens ``arr``): runs without images in one C++ call each,
        a block with image positions alone, with its image keys as extra bytes."""
        t = self.tokens_per_block
        out = np.empty((stop - first, 2), dtype=np.uint64)
        done = first
        for b in [*_image_blocks(images, first, stop, t), stop]:
            if b > done:  # the image-free run [done, b)
                run = self._hasher.chain(arr[(done - first) * t : (b - first) * t], t, parent)
                out[done - first : b - first] = run
                parent = run[-1]
            if b == stop:
                break
            block = arr[(b - first) * t : (b - first + 1) * t]
            parent = self._hasher.block(parent, block, _image_extra(images, b * t, (b + 1) * t))
            out[b - first] = parent
            done = b + 1
        return out


class TokenCount:
    """A request's token count without its ids: the `IntBuffer` surface `LiveRequest`
    uses when identities come from the caller (`BlockIdentity.digest_block_size`)."""

    __slots__ = ("size",)

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def extend(self, values: Sequence[int] | np.ndarray) -> None:
        self.size += len(values)


def digest_identities(
    digests: Sequence[bytes], digest_block_size: int, tokens_per_block: int, first: int, stop: int
) -> np.ndarray:
    """Identities ``(k, 2)`` of blocks ``first..first + k`` named by the caller's chained
    digests (one per ``digest_block_size`` tokens): the first 16 bytes of each block's
    last digest. ``k <= stop - first``: naming stops at the first block whose digest the
    caller has not produced, and a block size no multiple of the digests' names nothing.
    """
    per_block, rest = divmod(tokens_per_block, digest_block_size)
    stop = min(stop, len(digests) // per_block) if per_block and not rest else first
    if stop <= first:
        return no_identities()
    picked = [digests[(i + 1) * per_block - 1] for i in range(first, stop)]
    if any(len(d) < 16 for d in picked):
        short = min(len(d) for d in picked)
        raise InvalidInput(f"a block digest needs at least 16 bytes, got one of {short}")
    data = b"".join([bytes(d[:16]) for d in picked])
    return np.frombuffer(data, dtype=np.uint64).reshape(-1, 2)


def image_block_hashes(
    hasher: _core.BlockHasher,
    content_hash: int,
    num_blocks: int,
    tokens_per_block: int,
    salt: int,
) -> np.ndarray:
    """Identities ``(num_blocks, 2)`` of one image's blocks in an image group (independent
    of the text prefix)."""
    head = b"jenga.image\0" + _int_bytes(content_hash)
    tail = _int_bytes(tokens_per_block) + _int_bytes(salt)
    out = no_identities() if not num_blocks else np.empty((num_blocks, 2), dtype=np.uint64)
    for i in range(num_blocks):
        out[i] = hasher.digest(head + _int_bytes(i) + tail)
    return out
