"""Speculative decoding on the jenga manager: vLLM's rules for the KV cache, in one place.

Rationale
    Every speculative method vLLM 0.32/0.33 ship touches the KV cache in up to four ways,
    and each is a rule vLLM's own manager applies:

    - lookahead slots (every method, n-gram and suffix included): the scheduler asks
      ``allocate_slots`` for ``num_lookahead_tokens`` more slots, which the manager
      already holds like any other token;
    - EAGLE / EAGLE-3 / MTP block drop (``use_eagle`` of vLLM's manager): the draft KV
      of a prefix's last token is written with the token after it, so a hit is served
      only where the cache also holds the block after it (vLLM matches one more block
      and drops it). Here that is the allocator's `jenga.config.HitProof`: one step of
      proof, which may reach the prompt's last token when vLLM's hybrid coordinator
      decides (several groups) and stays below it on its single-group coordinator;
    - multi-module MTP re-prefill (``num_prefill_lookahead``): the last
      ``num_prefill_lookahead - 1`` computed tokens may be recomputed, so they are not
      cached yet;
    - 0.33's lookahead block hashes (``num_hash_lookahead_tokens``): a block's digest
      covers tokens after it, so it exists later; the manager names blocks by the
      request's digests only once they exist, and the hashes prove the boundary token,
      so no block is dropped (vLLM clears ``use_eagle`` then).

    Draft layers (EAGLE heads, a draft model) are KV-cache groups of their own or share
    the target's, as vLLM's config lays them out; the layout serves them as any group.

Approach
    `SpeculativeSetup` holds the scheduler's values; `install_jenga_manager` and the
    drop-in constructor build one and hand it to `JengaKVCacheManager`, which asks it
    for the allocator's hit proof and the cacheable token count.

Limitations
    The proof is required in every token group (vLLM requires it in the groups it flags
    as EAGLE groups, all of them when none is flagged), so a hit may be a step shorter
    than vLLM's where a non-draft sliding-window group lost the block below its window;
    never longer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jenga.config import HitProof


@dataclass(frozen=True)
class SpeculativeSetup:
    """What speculative decoding asks of the manager (all off: plain decoding).

    ``use_eagle``: vLLM's ``use_eagle_block_drop`` (EAGLE, EAGLE-3, MTP; vLLM's scheduler
    clears it when lookahead hashes prove the boundary); ``num_prefill_lookahead``:
    vLLM's multi-module MTP prefill lookahead; ``num_hash_lookahead_tokens``: 0.33's
    lookahead block hashes.
    """

    use_eagle: bool = False
    num_prefill_lookahead: int = 0
    num_hash_lookahead_tokens: int = 0

    def __post_init__(self) -> None:
        if self.num_prefill_lookahead < 0 or self.num_hash_lookahead_tokens < 0:
            raise ValueError(
                f"num_prefill_lookahead {self.num_prefill_lookahead} and "
                f"num_hash_lookahead_tokens {self.num_hash_lookahead_tokens} must be >= 0"
            )

    @property
    def num_reprefillable_tokens(self) -> int:
        """Computed tokens multi-module MTP may recompute (not cached yet)."""
        return max(0, self.num_prefill_lookahead - 1)

    def hit_proof(self, num_groups: int, marked: tuple[int, ...] = ()) -> HitProof | None:
        """The allocator's proof: vLLM's single-group coordinator matches the dropped
        block below the prompt's last token, its hybrid one up to the prompt's end; each
        group drops one of its own blocks (its hash unit inside blocks), only the groups
        the config ``marked`` as EAGLE's where it marks any (vLLM's ``is_eagle_group``)."""
        if not self.use_eagle:
            return None
        groups = marked or None
        return HitProof(steps=1, to_prompt_end=num_groups > 1, per_block=True, groups=groups)

    def cacheable(self, num_computed_tokens: int) -> int:
        """Of ``num_computed_tokens``, those whose KV is final (vLLM's
        ``get_num_cacheable_tokens``)."""
        return max(0, num_computed_tokens - self.num_reprefillable_tokens)

    def check(self, scheduler_block_size: int, enable_caching: bool) -> None:
        """vLLM's coordinator check: with prefix caching, multi-module MTP's re-prefilled
        tail must fit in the dropped block (`ValueError` otherwise, as vLLM raises)."""
        if enable_caching and self.use_eagle and scheduler_block_size < self.num_prefill_lookahead:
            raise ValueError(
                "Multi-module MTP with prefix caching requires scheduler_block_size"
                f" (={scheduler_block_size}) >= num_speculative_tokens"
                f" (={self.num_prefill_lookahead})."
            )


def speculative_setup_of(scheduler: Any) -> SpeculativeSetup:
    """The setup vLLM's `Scheduler` derived from its config (the values it passes its
    own `KVCacheManager`)."""
    return SpeculativeSetup(
        use_eagle=bool(getattr(scheduler, "use_eagle_block_drop", False)),
        num_prefill_lookahead=int(getattr(scheduler, "num_prefill_lookahead", 0) or 0),
        num_hash_lookahead_tokens=int(getattr(scheduler, "num_hash_lookahead_tokens", 0) or 0),
    )


def marked_eagle_groups(kv_cache_config: Any) -> tuple[int, ...]:
    """The KV-cache groups vLLM's config marks as EAGLE's (``is_eagle_group``; none
    without a config)."""
    groups = () if kv_cache_config is None else kv_cache_config.kv_cache_groups
    return tuple(g for g, grp in enumerate(groups) if getattr(grp, "is_eagle_group", False))
