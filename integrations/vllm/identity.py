"""Block identity is vLLM's: the request's own ``block_hashes`` name its blocks in the core.

Rationale
    vLLM puts into every block's identity the LoRA adapter, the prompt embeddings,
    multimodal features and the cache salt, hashed with the configured
    ``prefix_caching_hash_algo`` (sha256 by default), and it computes those digests for
    every request anyway. Hashing the tokens a second time (the core's own BLAKE2b
    chain) and checking one identity against the other cost more scheduler time than
    vLLM's whole manager; and only vLLM's digest knows what vLLM keeps apart (two LoRA
    adapters, two prompt-embeds requests with their all-zero token ids).

Approach
    - The manager's allocator names text blocks by vLLM's digests
      (`jenga.prefix.BlockIdentity.digest_block_size` = the hash block size): a group
      with ``t = m * H`` tokens per block takes the digest of its last ``H``-block, which
      chains over everything before. The core indexes 64 bits of it and compares 128 on
      every hit, so there is one hash per block (vLLM's) and no second registry to check;
      a lookup stops at the first digest the core never committed, as vLLM's does.
    - `request_salt` still folds cache salt, LoRA name and prompt-embeds into the salt of
      the groups the core keys itself (cross-attention image blocks).
    - `DigestRegistry` exists for vLLM's KV events only (``enable_kv_cache_events``):
      a commit is a ``BlockStored`` shaped as vLLM's (one per group and commit, with
      LoRA, extra keys and session id), built from the request's digests at commit
      time; the digest of each such block is kept so that a recorded block whose id is
      handed out again (evicted) or whose page is unmapped becomes a ``BlockRemoved``.
      With events off nothing is recorded per block.

Limitations
    A request without ``block_hashes`` (prefix caching off in vLLM, or a test building
    `Request` s without a hasher) never gets a hit and commits nothing. Groups whose
    block size is not a multiple of the hash block size name no block (vLLM refuses
    such prefix-cacheable groups); cross-attention (encoder) groups are keyed by the
    core (vLLM does not cache cross-attention at all).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

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


class DigestRegistry:
    """vLLM's KV events: ``BlockStored`` per commit, ``BlockRemoved`` per block whose
    content goes, from the digest recorded per (group, allocator block id).

    Invariant: an entry exists only for a block committed to the core's index by this
    manager while events are on, and not handed out again or unmapped since.
    """

    def __init__(self, layout: JengaLayout, hash_block_size: int, events: bool) -> None:
        self.layout = layout
        self.hash_block_size = hash_block_size
        self.events_on = events
        self.events: list[KVCacheEvent] = []
        self.digest: list[dict[int, bytes]] = [{} for _ in layout.groups]
        # per group: how many vLLM hash blocks one group block spans (0: not verified)
        self.span = [self._span(g.kind, g.block_size) for g in layout.groups]
        # 0.33's lookahead hashes: tokens after a block its digest covers (events name them)
        self.lookahead_tokens = 0

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
        hashes: list[bytes | int],
        start: int,
        stop: int,
    ) -> BlockStored:
        size = self.layout.groups[group].block_size
        parent = self.digest_of(request, group, start - 1) if start else None
        lora = getattr(request, "lora_request", None)
        ahead = self.lookahead_tokens
        extra, lookahead = [], []
        mm_index = 0
        for i in indices:
            end = (i + 1) * size
            keys, mm_index = generate_block_hash_extra_keys(
                request, i * size, end + ahead, mm_index
            )
            while ahead and mm_index > 0:  # keep inputs that reach into the next block
                position = request.mm_features[mm_index - 1].mm_position
                if position.offset + position.length <= end:
                    break
                mm_index -= 1
            extra.append(keys)
            lookahead.append(list(request.all_token_ids[end : end + ahead]))
        more = {"lookahead_token_ids": lookahead} if ahead else {}
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
            **more,
        )

    def forget(self, group: int, blocks: Iterable[int]) -> None:
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
