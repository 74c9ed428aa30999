"""Block identity is vLLM's: the request's own ``block_hashes`` decide what may be shared.

Rationale
    vLLM puts into every block's identity the LoRA adapter, the prompt embeddings,
    multimodal features and the cache salt, hashed with the configured
    ``prefix_caching_hash_algo`` (sha256 by default). The jenga core indexes blocks by a
    64-bit key it derives from token ids, a per-request salt and image identities, so on
    its own it would share KV between requests vLLM keeps apart (two LoRA adapters,
    two prompt-embeds requests with their all-zero token ids), and a 64-bit collision
    could serve another prompt's KV.

Approach
    - The core's key is only a *short* key: `request_salt` folds what the token ids do
      not carry (cache salt, LoRA name, and for prompt-embeds requests the first block's
      vLLM digest) into the root of the core's hash chain, so requests vLLM keeps apart
      rarely even meet in the index.
    - The *full* identity is vLLM's digest. `DigestRegistry` records, for every block
      the manager commits, the vLLM digest of that block (``block_hashes`` at the hash
      block size; a group with ``t = m * H`` tokens per block takes the digest of its
      last ``H``-block, which chains over everything before). On a hit, every hit block
      of every text group is checked against the request's own digest; one mismatch
      (a short-key collision, or identity the short key does not carry) and the request
      gets no hit at all — it computes its prefix, never reads the wrong KV.
    - The registry is also the source of vLLM's KV events: a commit is a
      ``BlockStored`` shaped as vLLM's (one per group and commit, with LoRA, extra keys
      and session id); a recorded block whose id is handed out again (evicted) or whose
      page is unmapped is a ``BlockRemoved``.

Limitations
    A request without ``block_hashes`` (prefix caching off in vLLM, or a test building
    `Request` s without a hasher) never gets a hit: nothing can be verified. Groups whose
    block size is not a multiple of the hash block size, and cross-attention (encoder)
    groups, are keyed by the core alone (vLLM does not cache cross-attention at all).
"""

from __future__ import annotations

import hashlib
from typing import Any

from jenga.allocator import NULL_BLOCK
from jenga.specs import Kind

from integrations.vllm.compat import (
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    Request,
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)
from integrations.vllm.layout import JengaLayout


def stable_int(value: object) -> int:
    """A 63-bit integer derived from ``str(value)`` (bytes as they are), the same in
    every process."""
    data = value if isinstance(value, bytes) else str(value).encode()
    digest = hashlib.blake2b(data, digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def request_salt(request: Request) -> int:
    """The core's per-request salt: cache salt, LoRA name, prompt-embeds digest (0: none)."""
    parts: list[bytes] = []
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts.append(b"salt:" + str(salt).encode())
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(b"lora:" + str(lora.name).encode())
    if getattr(request, "prompt_embeds", None) is not None:
        hashes = getattr(request, "block_hashes", None) or ()
        # the first block's digest covers its embeddings; without one, the request id
        # keeps it apart (such a request shares nothing, as vLLM cannot key it either)
        parts.append(b"embeds:" + (bytes(hashes[0]) if hashes else str(request).encode()))
    return stable_int(b"\0".join(parts)) if parts else 0


PLACEHOLDER_IDS = 1 << 40
"""Core token id of vLLM placeholder id -1 (then -2 → this + 1, ...): above every vocabulary."""


def core_token_ids(request: Request, tokens: Any) -> Any:
    """``tokens`` of ``request`` as the jenga core takes them (ids >= 0).

    vLLM's manager never reads token ids; multimodal and prompt-embeds requests may carry
    placeholder ids (vLLM's own tests use -1 for image positions). For such requests a
    negative id ``v`` becomes ``PLACEHOLDER_IDS - 1 - v``: keyed apart from every real id,
    and the block's identity stays vLLM's digest (`DigestRegistry.verify`). Any other
    request's ids go to the core unchanged, which refuses a negative id (`InvalidInput`).
    """
    placeholders = getattr(request, "mm_features", None) or (
        getattr(request, "prompt_embeds", None) is not None
    )
    if not placeholders or len(tokens) == 0 or min(tokens) >= 0:
        return tokens
    return [t if t >= 0 else PLACEHOLDER_IDS - 1 - t for t in tokens]


class DigestRegistry:
    """vLLM digest of every block the manager committed, per (group, allocator block id).

    Invariant: an entry exists only for a block committed to the core's index by this
    manager and not handed out again or unmapped since.
    """

    def __init__(self, layout: JengaLayout, hash_block_size: int, events: bool) -> None:
        self.layout = layout
        self.hash_block_size = hash_block_size
        self.events_on = events
        self.events: list[KVCacheEvent] = []
        self.digest: list[dict[int, bytes]] = [{} for _ in layout.groups]
        # per group: how many vLLM hash blocks one group block spans (0: not verified)
        self.span = [self._span(g.kind, g.block_size) for g in layout.groups]

    def _span(self, kind: Kind, block_size: int) -> int:
        if kind is Kind.CROSS_ATTENTION or block_size % self.hash_block_size:
            return 0
        return block_size // self.hash_block_size

    def digest_of(self, request: Request, group: int, block: int) -> bytes | None:
        """vLLM's digest of block ``block`` of ``group`` for this request (None: unknown)."""
        span = self.span[group]
        hashes = getattr(request, "block_hashes", None) or ()
        index = (block + 1) * span - 1
        return bytes(hashes[index]) if span and index < len(hashes) else None

    def verify(self, request: Request, tables: list[list[int]]) -> bool:
        """True when every recorded hit block carries this request's own digest."""
        for g, table in enumerate(tables):
            if not self.span[g]:
                continue
            known = self.digest[g]
            for i, block in enumerate(table):
                if block == NULL_BLOCK:
                    continue
                want = self.digest_of(request, g, i)
                if want is None or known.get(block) != want:
                    return False
        return True

    def record(
        self, request: Request, group: int, blocks: dict[int, int], start: int, stop: int
    ) -> None:
        """Blocks ``{index: id}`` of ``group`` this request just committed to the index.

        ``start .. stop`` is the block index range the commit covered (``blocks`` holds
        its live, newly indexed entries). As vLLM's ``cache_full_blocks``, one
        ``BlockStored`` covers the range: its recorded blocks' hashes, the parent hash
        of block ``start - 1`` and the token ids of the whole range.
        """
        if not self.span[group]:
            return
        hashes = []
        indices = []
        for i, block in sorted(blocks.items()):
            digest = self.digest_of(request, group, i)
            if digest is None:
                continue
            self.digest[group][block] = digest
            hashes.append(maybe_convert_block_hash(digest))
            indices.append(i)
        if self.events_on and stop > start:
            self.events.append(self._stored(request, group, indices, hashes, start, stop))

    def _stored(
        self,
        request: Request,
        group: int,
        indices: list[int],
        hashes: list[Any],
        start: int,
        stop: int,
    ) -> BlockStored:
        size = self.layout.groups[group].block_size
        parent = self.digest_of(request, group, start - 1) if start else None
        lora = getattr(request, "lora_request", None)
        extra = []
        mm_index = 0
        for i in indices:
            keys, mm_index = generate_block_hash_extra_keys(
                request, i * size, (i + 1) * size, mm_index
            )
            extra.append(keys)
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=None if parent is None else maybe_convert_block_hash(parent),
            token_ids=list(request.all_token_ids[start * size : stop * size]),
            block_size=size,
            lora_id=lora.adapter_id if lora is not None else None,
            medium="GPU",
            lora_name=lora.name if lora is not None else None,
            extra_keys=to_event_extra_keys(extra),
            group_idx=group,
            session_id=getattr(request, "session_id", None),
        )

    def forget(self, group: int, blocks: Any) -> None:
        """These block ids of ``group`` lost their content (reused or unmapped)."""
        known = self.digest[group]
        for block in blocks:
            digest = known.pop(int(block), None)
            if digest is not None and self.events_on:
                self.events.append(
                    BlockRemoved(
                        block_hashes=[maybe_convert_block_hash(digest)],
                        medium="GPU",
                        group_idx=group,
                    )
                )

    def forget_page(self, group: int, page: int) -> None:
        per_page = self.layout.groups[group].pages.blocks_per_large_page
        self.forget(group, range(page * per_page, (page + 1) * per_page))

    def clear(self) -> None:
        self.digest = [{} for _ in self.layout.groups]

    def take_events(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events
