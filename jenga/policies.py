"""Per-kind cache policies: which blocks a length needs, and which prefixes a group can serve.

Rationale
    Layer kinds differ in which tokens they read (paper §5.2): full attention reads every
    token, a sliding window the last ``w``, chunked local attention its current chunk,
    Mamba only its running state, cross attention every image token; MLA reads every
    token's latent (sliding-window MLA those of its window, compressed MLA one state per
    ``tokens_per_state`` tokens), sink full attention every token after the engine's
    sink tokens; replayed sliding-window MLA reads its window but caches nothing (a hit
    recomputes it), a circular buffer is one ring block per request. The allocator is the
    same for all of them; what differs is captured by four questions, one class per kind,
    picked from `POLICY_BY_KIND` (the paper's customizable interface):

    - `num_blocks(length)` / `first_live_block(length)`: the block indices
      ``[first_live_block, num_blocks)`` must be allocated for a request of ``length``
      tokens that continues computing (``blocks_needed`` of the paper: blocks below the
      first live one are released to the cache);
    - `active_blocks(length)`: the blocks whose last access a step refreshes
      (``update_last_access``);
    - `prefix_length(block)`: the eviction tie-break (``set_prefix_length``): the token
      count up to the end of the block, shared by every group so eviction stays aligned;
    - `possible_prefix(is_hit)`: every prefix length (in tokens, > 0) this group could
      serve given which of the prompt's blocks are cached.

    This module is the one home of each kind's rules. Which tokens a kind keeps is
    `attended_start(position)` (the first token the token at ``position`` reads) and
    `kept_tokens(length)` derived from it; `first_live_block`, the page math's
    `jenga.pages.tokens_needed` and the simulator's `jenga.sim.needs` all read those.
    Kind traits other modules branch on are class attributes: `reads_images`,
    `releases_early` (blocks leave a window or chunk while the request runs: the core's
    early releases), `holds_state` (one fixed-size state, not a per-token cache; Mamba),
    `prefill_only` (read only while the prompt is prefilled; vision embeddings),
    `caches_blocks` (False: the group's blocks never enter the prefix cache; a hit leaves
    its live blocks to be recomputed, `hit_table_length`), and `block_tokens(spec)`
    (tokens one block covers: Mamba's checkpoint interval).
    `policy_for(spec)` builds the policy of a `LayerSpec`; `make_policy` of a kind.

Approach
    Lengths are token counts; block ``i`` of an attention group covers tokens
    ``[i*T, (i+1)*T)``. A Mamba group uses ``T = checkpoint_interval``: block ``i`` holds
    the state after ``(i+1)*T`` tokens, the live state while ``length`` is in
    ``(i*T, (i+1)*T]``, and a cacheable checkpoint once the request moved past it.
    Image kinds (cross attention, vision embeddings) cover image tokens only: image j's
    blocks follow image j-1's, each image starting a fresh block, so an image is cached,
    hit and evicted as a unit (every block of an image shares one prefix length: the
    image's end position).

Limitations
    Prefix lengths are block-aligned in every text group, so a hit is a multiple of each
    text group's block size. Image kinds return positions at token granularity, so
    `possible_prefix` for them enumerates up to ``num_tokens`` positions.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol

import numpy as np

from jenga.specs import Kind, LayerSpec, SpecError


class Image(Protocol):
    """What image-aware policies read from an image span."""

    @property
    def start(self) -> int: ...

    @property
    def length(self) -> int: ...

    @property
    def end(self) -> int: ...


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class StateExtension(NamedTuple):
    """One state group's table growth in a step, in table order: ``skipped`` NULL
    entries, then ``moved`` scratch blocks taken from below the running state (their old
    entries become NULL), then ``new`` blocks from the allocator."""

    skipped: int
    moved: int
    new: int

    def keeping_checkpoint(self) -> StateExtension:
        """The same growth with the entry just below the running state a block of its
        own (an engine that writes a checkpoint state there inside the step: vLLM's
        internal prefill checkpoint); unchanged where that entry is not a skipped one."""
        if not self.skipped or self.moved:
            return self
        return StateExtension(self.skipped - 1, 0, self.new + 1)


@dataclass(frozen=True)
class Policy:
    """Full attention: every token is read, every block stays, any cached prefix is valid."""

    tokens_per_block: int
    kind: ClassVar[Kind] = Kind.FULL
    reads_images: ClassVar[bool] = False
    # blocks leave the window / chunk while the request runs (the core's early releases)
    releases_early: ClassVar[bool] = False
    # one fixed-size state per request, not a per-token cache; live table entries may be
    # NULL (checkpoints a step skipped)
    holds_state: ClassVar[bool] = False
    # read only while the prompt is prefilled (released once the prompt is done)
    prefill_only: ClassVar[bool] = False
    # its blocks enter the prefix cache (False: never committed, never hit; a hit of the
    # other groups leaves this group's live blocks to be allocated and recomputed)
    caches_blocks: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.tokens_per_block <= 0:
            raise SpecError(f"tokens_per_block must be > 0, got {self.tokens_per_block}")

    @classmethod
    def block_tokens(cls, spec: LayerSpec) -> int:
        """Tokens one block of a layer with ``spec`` covers (its `tokens_per_block`)."""
        return spec.block_size

    def attended_start(self, position: int) -> int:
        """First token position the token at ``position`` reads (full attention: 0)."""
        return 0

    @property
    def window_blocks(self) -> int:
        """Blocks a request keeps once its window has passed (the most that a span of
        `window_span` tokens touches); 0 for a kind that does not release early."""
        span = self.window_span
        return (span - 2) // self.tokens_per_block + 2 if span > 0 else 0

    @property
    def window_span(self) -> int:
        """Tokens the last token reads at most, for a kind that releases early; else 0."""
        return 0

    @property
    def retention_reach(self) -> int:
        """Tokens before a retention boundary that a prefix hit there reads, for a kind a
        positive retention interval thins (`jenga.config.AllocationRules`); -1 for every
        other kind (its blocks are never demoted by retention)."""
        return -1

    def kept_tokens(self, length: int) -> int:
        """How many of a request's first ``length`` tokens this layer still holds once all
        are computed: those the last of them read (0 for a state kind)."""
        return length - self.attended_start(length - 1) if length > 0 else 0

    def num_blocks(self, length: int, images: Sequence[Image] = ()) -> int:
        """Blocks a request of ``length`` tokens has (allocated or released)."""
        return _ceil_div(length, self.tokens_per_block)

    def first_live_block(self, length: int, images: Sequence[Image] = ()) -> int:
        """Lowest block index still read by the token at position ``length``."""
        return self.attended_start(length) // self.tokens_per_block

    def last_length_held(self, num_blocks: int) -> int | None:
        """The largest length whose `num_blocks` is <= ``num_blocks`` (None: no closed
        form, e.g. image policies; `LiveRequest.update_quiet_span` then searches)."""
        if type(self).num_blocks is not Policy.num_blocks:
            return None
        return num_blocks * self.tokens_per_block

    def last_length_first_live(self, first: int) -> int | None:
        """The largest length whose `first_live_block` is <= ``first`` (`sys.maxsize`: every
        length; None: no closed form)."""
        cls = type(self)
        if cls.first_live_block is not Policy.first_live_block:
            return None
        if cls.attended_start is not Policy.attended_start:
            return None
        return sys.maxsize  # full attention reads from token 0: block 0 stays live

    def counted_length(self, length: int, lookahead: int) -> int:
        """Of a request's ``length`` tokens (the last ``lookahead`` of them a draft's
        lookahead slots), those this kind holds blocks for (all of them)."""
        return length

    def scratch_blocks(self) -> int:
        """Blocks a table keeps after its live ones that never hold a checkpoint."""
        return 0

    def extension(self, num_held: int, speculative_tail: bool, length: int) -> StateExtension:
        """How a table of ``num_held`` entries grows to serve ``length`` tokens: new
        blocks up to `num_blocks` (state kinds may also skip and move entries)."""
        return StateExtension(0, 0, max(0, self.num_blocks(length) - num_held))

    def active_blocks(self, length: int, images: Sequence[Image] = ()) -> range:
        """Blocks whose last access the step computing position ``length`` refreshes."""
        return range(self.first_live_block(length, images), self.num_blocks(length, images))

    def prefix_length(self, block: int, images: Sequence[Image] = ()) -> int:
        """Eviction tie-break: tokens up to the end of ``block`` (longest prefix evicted first)."""
        return (block + 1) * self.tokens_per_block

    def hit_blocks(self, prefix: int, images: Sequence[Image] = ()) -> range:
        """Block indices a request starting from a cached ``prefix`` takes from the cache."""
        return range(self.first_live_block(prefix, images), prefix // self.tokens_per_block)

    def hit_table_length(self, prefix: int, images: Sequence[Image] = ()) -> int:
        """Entries of the block table a request starts with after a ``prefix`` hit: every
        block the prefix covers (NULL below `hit_blocks`); the request's next allocation
        adds the blocks past them."""
        return self.num_blocks(prefix, images)

    def possible_prefix(
        self, is_hit: Sequence[bool], num_tokens: int = 0, images: Sequence[Image] = ()
    ) -> set[int]:
        """Prefix lengths p > 0 whose blocks ``hit_blocks(p)`` are all cached."""
        valid: set[int] = set()
        for k in range(1, len(is_hit) + 1):
            p = k * self.tokens_per_block
            if all(is_hit[i] for i in self.hit_blocks(p, images)):
                valid.add(p)
        return valid

    def hit_bounds(
        self, p: np.ndarray, images: Sequence[Image] = ()
    ) -> tuple[np.ndarray, np.ndarray]:
        """`hit_blocks` for an array of block-aligned prefix lengths: (starts, stops)."""
        return np.zeros_like(p), p // self.tokens_per_block

    def valid_prefix_mask(
        self, is_hit: np.ndarray, step: int, num_tokens: int, images: Sequence[Image] = ()
    ) -> np.ndarray:
        """`possible_prefix` vectorized: for p = step, 2*step, ... <= num_tokens, is p valid?

        ``step`` must be a multiple of ``tokens_per_block``. Agrees with `possible_prefix`
        on those positions (tests check it); costs O(blocks) numpy work, no Python loop.
        """
        p = step * np.arange(1, num_tokens // step + 1, dtype=np.int64)
        lo, hi = self.hit_bounds(p, images)
        misses = np.concatenate(([0], np.cumsum(~np.asarray(is_hit, dtype=bool))))
        n = len(is_hit)
        stop = np.minimum(hi, n)
        start = np.minimum(np.maximum(lo, 0), stop)
        return (hi <= n) & (misses[stop] - misses[start] == 0)


@dataclass(frozen=True)
class FullAttentionPolicy(Policy):
    """All tokens; the valid prefixes are exactly the leading run of cached blocks.

    ``token_fraction = (num, den)`` (PyramidKV-style layers) keeps ``ceil(L * num / den)``
    of a request's tokens; which tokens survive depends on attention scores, so such a
    group serves no prefix hit.
    """

    token_fraction: tuple[int, int] = (1, 1)

    def __post_init__(self) -> None:
        super().__post_init__()
        num, den = self.token_fraction
        if not 0 < num <= den:
            raise SpecError(f"token_fraction must satisfy 0 < num <= den, got {num}/{den}")

    def kept_tokens(self, length: int) -> int:
        """``ceil(length * num / den)``: a count, the tokens are picked by score (so the
        first live block stays 0)."""
        num, den = self.token_fraction
        return _ceil_div(max(0, length) * num, den)

    def num_blocks(self, length: int, images: Sequence[Image] = ()) -> int:
        return _ceil_div(self.kept_tokens(length), self.tokens_per_block)

    def last_length_held(self, num_blocks: int) -> int | None:
        if self.token_fraction != (1, 1):
            return None
        return num_blocks * self.tokens_per_block

    def possible_prefix(
        self, is_hit: Sequence[bool], num_tokens: int = 0, images: Sequence[Image] = ()
    ) -> set[int]:
        if self.token_fraction != (1, 1):
            return set()
        run = 0
        while run < len(is_hit) and is_hit[run]:
            run += 1
        return {k * self.tokens_per_block for k in range(1, run + 1)}

    def valid_prefix_mask(
        self, is_hit: np.ndarray, step: int, num_tokens: int, images: Sequence[Image] = ()
    ) -> np.ndarray:
        if self.token_fraction != (1, 1):
            return np.zeros(num_tokens // step, dtype=bool)
        # the leading run of hits, as in `possible_prefix` (fewer array passes than the
        # general form: this runs on every prefix lookup)
        misses = np.flatnonzero(~np.asarray(is_hit, dtype=bool))
        run = int(misses[0]) if len(misses) else len(is_hit)
        p = step * np.arange(1, num_tokens // step + 1, dtype=np.int64)
        return p <= run * self.tokens_per_block


@dataclass(frozen=True)
class SlidingWindowPolicy(Policy):
    """Window ``w`` (tokens attended, the current one included)."""

    window: int
    kind: ClassVar[Kind] = Kind.SLIDING_WINDOW
    releases_early: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window <= 0:
            raise SpecError(f"sliding window must be > 0, got {self.window}")

    def attended_start(self, position: int) -> int:
        """The last ``window`` tokens, the current one included."""
        return max(0, position - self.window + 1)

    @property
    def window_span(self) -> int:
        return self.window

    @property
    def retention_reach(self) -> int:
        """A hit at length R reads tokens from `attended_start` (R) = R - window + 1."""
        return self.window - 1

    def last_length_first_live(self, first: int) -> int | None:
        # max(0, L - w + 1) // t <= first  <=>  L - w + 1 <= (first + 1) * t - 1
        return (first + 1) * self.tokens_per_block + self.window - 2

    def hit_bounds(
        self, p: np.ndarray, images: Sequence[Image] = ()
    ) -> tuple[np.ndarray, np.ndarray]:
        t = self.tokens_per_block  # `attended_start` over an array
        return np.maximum(0, p - self.window + 1) // t, p // t


@dataclass(frozen=True)
class MLAPolicy(FullAttentionPolicy):
    """Multi-head latent attention: one latent per token (its page is half a K/V page of
    the same width), read by every later token, so full attention's rules hold: every
    block stays and the valid prefixes are the leading run of cached blocks."""

    kind: ClassVar[Kind] = Kind.MLA


@dataclass(frozen=True)
class CompressedMLAPolicy(MLAPolicy):
    """MLA whose pages hold one state per ``tokens_per_state`` tokens (DeepSeek-V4's
    compressed MLA; the spec's `tokens_per_state` divides its block size). Every later
    token reads every state, so full attention's rules hold; a block's states are all
    written once its tokens are, and hits are block-aligned, so a hit never ends inside a
    state. Only the page differs (`jenga.specs.LayerSpec.page_bytes`)."""

    kind: ClassVar[Kind] = Kind.COMPRESSED_MLA


@dataclass(frozen=True)
class SinkFullAttentionPolicy(FullAttentionPolicy):
    """Full attention behind static sink tokens (vLLM's ``SinkFullAttentionSpec``).

    The sink K/V are the model's, written once by the engine in blocks no request owns;
    a request's own tokens follow full attention's rules (as vLLM's
    ``SinkFullAttentionManager``, a ``FullAttentionManager``, treats them).
    """

    kind: ClassVar[Kind] = Kind.SINK_FULL


@dataclass(frozen=True)
class SlidingWindowMLAPolicy(SlidingWindowPolicy):
    """MLA latents read over a window of ``w`` tokens: the sliding window's rules (blocks
    leave the window; a prefix needs only the blocks its last token reads), one latent
    per token in each block."""

    kind: ClassVar[Kind] = Kind.SLIDING_WINDOW_MLA


@dataclass(frozen=True)
class ReplaySlidingWindowMLAPolicy(SlidingWindowMLAPolicy):
    """Sliding-window MLA rebuilt by recomputation (vLLM's bounded replay): its blocks are
    never cached, and a prefix hit of the other groups is served by recomputing the hit's
    last ``w`` tokens into fresh blocks of this group.

    The group takes no block from a hit and so accepts every prefix length; a request
    with a ``p``-token hit starts with NULL entries below the window of token ``p``
    (`hit_table_length`), and its next allocation takes the window's blocks with the new
    ones. The engine recomputes the replayed tokens; how many it replays (the window) is
    its business, which blocks hold them is this policy's.
    """

    kind: ClassVar[Kind] = Kind.REPLAY_SLIDING_WINDOW_MLA
    caches_blocks: ClassVar[bool] = False

    def hit_blocks(self, prefix: int, images: Sequence[Image] = ()) -> range:
        first = self.first_live_block(prefix, images)
        return range(first, first)

    def hit_table_length(self, prefix: int, images: Sequence[Image] = ()) -> int:
        return self.first_live_block(prefix, images)

    def possible_prefix(
        self, is_hit: Sequence[bool], num_tokens: int = 0, images: Sequence[Image] = ()
    ) -> set[int]:
        return {k * self.tokens_per_block for k in range(1, len(is_hit) + 1)}

    def hit_bounds(
        self, p: np.ndarray, images: Sequence[Image] = ()
    ) -> tuple[np.ndarray, np.ndarray]:
        first = np.maximum(0, p - self.window + 1) // self.tokens_per_block
        return first, first


@dataclass(frozen=True)
class CircularBufferPolicy(Policy):
    """A ring of ``tokens_per_block`` rows (vLLM's ``CircularBufferSpec``: DeepSeek-V4's
    compressor state, the rows of the token group still being compressed): one block per
    request from its first token to its end, overwritten in place, never cached.

    A prefix hit of the other groups takes nothing from this group (every length is
    valid for it) and the request claims its ring with its next allocation.
    """

    kind: ClassVar[Kind] = Kind.CIRCULAR_BUFFER
    caches_blocks: ClassVar[bool] = False

    def kept_tokens(self, length: int) -> int:
        return min(max(0, length), self.tokens_per_block)

    def num_blocks(self, length: int, images: Sequence[Image] = ()) -> int:
        return 1 if length > 0 else 0

    def first_live_block(self, length: int, images: Sequence[Image] = ()) -> int:
        return 0

    def last_length_held(self, num_blocks: int) -> int | None:
        return sys.maxsize if num_blocks >= 1 else 0

    def last_length_first_live(self, first: int) -> int | None:
        return sys.maxsize

    def hit_blocks(self, prefix: int, images: Sequence[Image] = ()) -> range:
        return range(0)

    def hit_table_length(self, prefix: int, images: Sequence[Image] = ()) -> int:
        return 0

    def possible_prefix(
        self, is_hit: Sequence[bool], num_tokens: int = 0, images: Sequence[Image] = ()
    ) -> set[int]:
        return {k * self.tokens_per_block for k in range(1, len(is_hit) + 1)}

    def valid_prefix_mask(
        self, is_hit: np.ndarray, step: int, num_tokens: int, images: Sequence[Image] = ()
    ) -> np.ndarray:
        return np.ones(num_tokens // step, dtype=bool)


@dataclass(frozen=True)
class ChunkedLocalPolicy(Policy):
    """Chunked local attention (Llama 4): a token reads its own chunk of ``chunk`` tokens."""

    chunk: int
    kind: ClassVar[Kind] = Kind.CHUNKED_LOCAL
    releases_early: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.chunk <= 0:
            raise SpecError(f"attention chunk must be > 0, got {self.chunk}")

    def attended_start(self, position: int) -> int:
        """The start of the position's own chunk."""
        return (position // self.chunk) * self.chunk

    @property
    def window_span(self) -> int:
        return self.chunk

    @property
    def window_blocks(self) -> int:
        """A chunk starts on a chunk boundary: ``chunk / t`` blocks when blocks tile it."""
        t = self.tokens_per_block
        return self.chunk // t if self.chunk % t == 0 else super().window_blocks

    def last_length_first_live(self, first: int) -> int | None:
        # (L // c) * c // t <= first  <=>  (L // c) * c <= (first + 1) * t - 1
        c = self.chunk
        return ((first + 1) * self.tokens_per_block - 1) // c * c + c - 1

    def hit_bounds(
        self, p: np.ndarray, images: Sequence[Image] = ()
    ) -> tuple[np.ndarray, np.ndarray]:
        t = self.tokens_per_block  # `attended_start` over an array
        return (p // self.chunk) * self.chunk // t, p // t


@dataclass(frozen=True)
class MambaPolicy(Policy):
    """One live state; a checkpoint every ``tokens_per_block`` tokens is cacheable.

    Block i = state after (i+1)*T tokens. The live state is the last block; the one
    before it is kept while a step crosses a boundary (the engine copies it forward).
    With ``step_end_only`` (an engine that writes the state only where a step ends, like
    vLLM's "align" Mamba cache mode) a step spanning several checkpoints holds only the
    state it starts from and the one it ends at (`extension`): the checkpoints in
    between are NULL table entries, so a table's live entries may have NULL holes.

    ``speculative_states`` (speculative decoding, vLLM's ``num_speculative_blocks``):
    the table holds that many more blocks after the running state, one per draft token
    the engine may keep a state for::

        | released / NULL | running state | speculative 1 .. s |
                            ceil(L/T) - 1

    They are scratch: never a checkpoint, never cached. When a step moves the running
    state past them, those left below it move to the table's end (`extension`), so a
    checkpoint index never names a block holding a draft's state.
    """

    step_end_only: bool = False  # the engine writes a state only where a step ends
    speculative_states: int = 0  # scratch states after the running one (draft tokens)
    kind: ClassVar[Kind] = Kind.MAMBA
    holds_state: ClassVar[bool] = True

    @classmethod
    def block_tokens(cls, spec: LayerSpec) -> int:
        """One block (state) per checkpoint interval."""
        return spec.checkpoint_interval

    def kept_tokens(self, length: int) -> int:
        return 0  # a state, not tokens

    def num_blocks(self, length: int, images: Sequence[Image] = ()) -> int:
        if length <= 0:
            return 0
        return _ceil_div(length, self.tokens_per_block) + self.speculative_states

    def hit_table_length(self, prefix: int, images: Sequence[Image] = ()) -> int:
        return _ceil_div(prefix, self.tokens_per_block)  # a hit holds no scratch states

    def last_length_held(self, num_blocks: int) -> int | None:
        return max(0, num_blocks - self.speculative_states) * self.tokens_per_block

    def first_live_block(self, length: int, images: Sequence[Image] = ()) -> int:
        return max(0, _ceil_div(length, self.tokens_per_block) - 1)

    def last_length_first_live(self, first: int) -> int | None:
        return (first + 1) * self.tokens_per_block  # ceil(L / t) - 1 <= first

    def counted_length(self, length: int, lookahead: int) -> int:
        # step-end mode: no state is written for a draft's lookahead slots
        return length - lookahead if self.step_end_only else length

    def scratch_blocks(self) -> int:
        return self.speculative_states

    def extension(self, num_held: int, speculative_tail: bool, length: int) -> StateExtension:
        """How a table of ``num_held`` entries grows to serve ``length`` tokens.

        ``speculative_tail``: the table ends with `speculative_states` scratch entries
        (the request was extended before; a table a prefix hit built has none). With
        ``step_end_only`` the entries below the running state that this step skips are
        NULL (a step spanning several checkpoints holds only the state it starts from
        and the one it ends at) and scratch entries below it move to the end; otherwise
        the table just grows (every checkpoint is written).
        """
        total = self.num_blocks(length)
        if total <= num_held:
            return StateExtension(0, 0, 0)
        if not self.step_end_only:
            return StateExtension(0, 0, total - num_held)
        running = self.first_live_block(length)
        tail = self.speculative_states if speculative_tail else 0
        moved = max(0, min(tail, running - (num_held - tail)))
        skipped = max(0, running - num_held)
        return StateExtension(skipped, moved, total - max(num_held, running) - moved)

    def hit_blocks(self, prefix: int, images: Sequence[Image] = ()) -> range:
        k = prefix // self.tokens_per_block
        return range(k - 1, k) if k > 0 else range(0)

    def hit_bounds(
        self, p: np.ndarray, images: Sequence[Image] = ()
    ) -> tuple[np.ndarray, np.ndarray]:
        k = p // self.tokens_per_block
        return k - 1, k


class _ImagePolicy(Policy):
    """Blocks over image tokens only; an image is one all-or-nothing unit."""

    reads_images: ClassVar[bool] = True

    def valid_prefix_mask(
        self, is_hit: np.ndarray, step: int, num_tokens: int, images: Sequence[Image] = ()
    ) -> np.ndarray:
        p = step * np.arange(1, num_tokens // step + 1, dtype=np.int64)
        mask = np.ones(len(p), dtype=bool)
        hits = np.asarray(is_hit, dtype=bool)
        for image, blocks in zip(images, self.image_ranges(images), strict=True):
            if blocks.stop > len(hits) or not hits[blocks.start : blocks.stop].all():
                mask &= ~self._needed_at(image, p)
        return mask

    def _needed_at(self, image: Image, p: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def image_blocks(self, image: Image) -> int:
        return _ceil_div(image.length, self.tokens_per_block)

    def image_ranges(self, images: Sequence[Image]) -> list[range]:
        """Block index range of each image, in image order."""
        out: list[range] = []
        start = 0
        for image in images:
            n = self.image_blocks(image)
            out.append(range(start, start + n))
            start += n
        return out

    def num_blocks(self, length: int, images: Sequence[Image] = ()) -> int:
        return sum(self.image_blocks(im) for im in images if im.start < length)

    def prefix_length(self, block: int, images: Sequence[Image] = ()) -> int:
        for image, blocks in zip(images, self.image_ranges(images), strict=True):
            if block in blocks:
                return image.end
        raise IndexError(f"block {block} is past the {len(images)} images' blocks")

    def _image_needed(self, image: Image, prefix: int) -> bool:
        raise NotImplementedError

    def hit_blocks(self, prefix: int, images: Sequence[Image] = ()) -> range:
        ranges = self.image_ranges(images)
        needed = [r for im, r in zip(images, ranges, strict=True) if self._image_needed(im, prefix)]
        if not needed:
            return range(0)
        return range(needed[0].start, needed[-1].stop)

    def possible_prefix(
        self, is_hit: Sequence[bool], num_tokens: int = 0, images: Sequence[Image] = ()
    ) -> set[int]:
        ranges = self.image_ranges(images)
        whole = [
            all(is_hit[i] for i in r if i < len(is_hit)) and r.stop <= len(is_hit) for r in ranges
        ]
        valid: set[int] = set()
        for p in range(1, num_tokens + 1):
            if all(whole[j] for j, im in enumerate(images) if self._image_needed(im, p)):
                valid.add(p)
        return valid


@dataclass(frozen=True)
class CrossAttentionPolicy(_ImagePolicy):
    """Cross attention over image tokens: every image before the position is read, always."""

    kind: ClassVar[Kind] = Kind.CROSS_ATTENTION

    def _image_needed(self, image: Image, prefix: int) -> bool:
        return image.start < prefix

    def _needed_at(self, image: Image, p: np.ndarray) -> np.ndarray:
        return image.start < p

    def first_live_block(self, length: int, images: Sequence[Image] = ()) -> int:
        return 0


@dataclass(frozen=True)
class VisionEmbeddingPolicy(_ImagePolicy):
    """Vision-encoder outputs: read while the image's placeholder tokens are prefilled.

    A prefix that ends inside an image needs the whole image's embeddings (all or
    nothing); images wholly before the prefix are not needed again and are released.
    """

    kind: ClassVar[Kind] = Kind.VISION_EMBEDDING
    prefill_only: ClassVar[bool] = True

    def _image_needed(self, image: Image, prefix: int) -> bool:
        return image.start < prefix < image.end

    def _needed_at(self, image: Image, p: np.ndarray) -> np.ndarray:
        return (image.start < p) & (p < image.end)

    def first_live_block(self, length: int, images: Sequence[Image] = ()) -> int:
        first = 0
        for image, blocks in zip(images, self.image_ranges(images), strict=True):
            if image.end > length:
                return blocks.start
            first = blocks.stop
        return first


POLICY_BY_KIND: dict[Kind, type[Policy]] = {
    Kind.FULL: FullAttentionPolicy,
    Kind.SLIDING_WINDOW: SlidingWindowPolicy,
    Kind.CHUNKED_LOCAL: ChunkedLocalPolicy,
    Kind.MAMBA: MambaPolicy,
    Kind.CROSS_ATTENTION: CrossAttentionPolicy,
    Kind.VISION_EMBEDDING: VisionEmbeddingPolicy,
    Kind.MLA: MLAPolicy,
    Kind.SLIDING_WINDOW_MLA: SlidingWindowMLAPolicy,
    Kind.SINK_FULL: SinkFullAttentionPolicy,
    Kind.REPLAY_SLIDING_WINDOW_MLA: ReplaySlidingWindowMLAPolicy,
    Kind.CIRCULAR_BUFFER: CircularBufferPolicy,
    Kind.COMPRESSED_MLA: CompressedMLAPolicy,
}


# every policy parameter, over all kinds (tokens_per_block is positional)
_PARAMETERS = {f.name for cls in POLICY_BY_KIND.values() for f in dataclasses.fields(cls)} - {
    "tokens_per_block"
}


def make_policy(kind: Kind, tokens_per_block: int, **params: Any) -> Policy:
    """The policy for ``kind`` from the dispatch table, with its parameters checked.

    ``params`` may hold any kind's parameters (``window``, ``chunk``, ``token_fraction``,
    ``step_end_only``: the policy classes' fields); the class takes its own and ignores
    the others, so a new kind needs only its class here. A parameter the class requires
    that is missing or None raises `SpecError`; one no policy has raises `TypeError`.
    """
    unknown = set(params) - _PARAMETERS
    if unknown:
        raise TypeError(f"make_policy: no policy takes {sorted(unknown)}")
    cls = POLICY_BY_KIND[kind]
    own: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name == "tokens_per_block":
            continue
        value = params.get(f.name)
        if value is not None:
            own[f.name] = value
        elif f.default is dataclasses.MISSING:
            raise SpecError(f"{kind} policy needs a {f.name}")
    return cls(tokens_per_block, **own)


@functools.cache
def policy_for(spec: LayerSpec, *, step_end_only: bool = False) -> Policy:
    """The policy of a layer with ``spec`` (cached: specs and policies are frozen)."""
    return make_policy(
        spec.kind,
        POLICY_BY_KIND[spec.kind].block_tokens(spec),
        window=spec.window,
        chunk=spec.chunk,
        token_fraction=spec.token_fraction,
        step_end_only=step_end_only,
        speculative_states=spec.speculative_states,
    )
