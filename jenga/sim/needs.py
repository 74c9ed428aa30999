"""What each layer kind must keep: the ground truth that KV waste is measured against.

Rationale
    "Waste" is memory an allocator holds for running requests that no future step will
    read. It is defined by the model, not by any allocator, so it lives here, once, and
    every allocator's holdings are compared with it.

Approach
    A request's sequence is ``image tokens + text tokens (+ generated)``. Each group sees
    one *role* of that sequence:

        role "image": the image tokens only     (cross attention, vision embedding)
        role "text":  everything after them     (self attention and Mamba in a model
                                                 with cross attention: Llama 3.2 Vision)
        role "all":   the whole sequence        (self attention and Mamba otherwise:
                                                 LLaVA-style models put the image in the
                                                 text stream; and uniform paging)

    `kept_interval` gives, in the group's own token coordinates, the tokens the group
    must still hold once ``n`` sequence tokens are computed. The kind's policy says which
    (`jenga.policies`, `Policy.kept_tokens`): a sliding window of w keeps the last w
    tokens (the window the last computed token attended); a chunked local layer keeps
    the current chunk; cross attention keeps the whole image for the life of the
    request; a vision-embedding cache (`prefill_only`) keeps the image until the prompt
    is done; Mamba (`holds_state`) keeps one state; a PyramidKV-style full layer keeps
    its token share.

    The engine measures waste per step against `step_needed_bytes`: what the step's
    tokens read or write (a prefill chunk also needs the window before it).

Limitations
    Needed bytes are summed per request, so tokens shared by two running requests (a
    common prefix) count twice; waste is then underestimated, never overestimated.
"""

from __future__ import annotations

from jenga.policies import policy_for
from jenga.specs import Kind, KVGroup, LayerSpec, ModelSpec


def role_of(spec: LayerSpec, model: ModelSpec) -> str:
    """Which part of the sequence a group stores ("image", "text" or "all").

    Image kinds store the image. Other layers see the image tokens only when the model
    has no cross attention (the image's embeddings sit in the text stream).
    """
    if policy_for(spec).reads_images:
        return "image"
    has_cross = any(g.spec.kind is Kind.CROSS_ATTENTION for g in model.groups)
    return "text" if has_cross else "all"


def group_length(role: str, n: int, image_tokens: int) -> int:
    """Tokens of the group's own coordinates covered by the first ``n`` sequence tokens."""
    if role == "image":
        return min(n, image_tokens)
    if role == "text":
        return max(0, n - image_tokens)
    return n


def kept_interval(spec: LayerSpec, length: int, prompt_done: bool) -> tuple[int, int]:
    """Tokens ``[start, end)`` (group coordinates) a group must hold at ``length`` tokens.

    Invariant: ``0 <= start <= end == length`` for token kinds; Mamba returns ``(0, 0)``
    (its state is not a token range; see `needed_bytes`).
    """
    policy = policy_for(spec)
    if policy.holds_state:
        return 0, 0
    if policy.prefill_only and prompt_done:
        return length, length
    return length - policy.kept_tokens(length), length


def group_needed_bytes(
    model: ModelSpec, group: KVGroup, n: int, image_tokens: int, prompt_done: bool
) -> int:
    """Bytes group ``group`` must hold for one request with ``n`` computed tokens."""
    spec = group.spec
    if policy_for(spec).holds_state:
        return group.num_layers * spec.page_bytes if n > 0 else 0
    length = group_length(role_of(spec, model), n, image_tokens)
    start, end = kept_interval(spec, length, prompt_done)
    return group.num_layers * spec.bytes_per_token * (end - start)


def needed_bytes(model: ModelSpec, n: int, image_tokens: int = 0, prompt_done: bool = False) -> int:
    """Bytes the whole model must hold for one request with ``n`` computed tokens."""
    return sum(group_needed_bytes(model, g, n, image_tokens, prompt_done) for g in model.groups)


def step_needed_bytes(
    model: ModelSpec, first: int, end: int, image_tokens: int = 0, prompt_done: bool = False
) -> int:
    """Bytes a step that computes sequence tokens ``[first, end)`` of a request reads or writes.

    Per group: from the start of the interval kept at ``first`` (what the chunk's first
    token attends) through ``end``. For decode (``end = first + 1``) this is what the next
    step needs too; for a prefill chunk it adds the chunk to the window before it.
    """
    total = 0
    for g in model.groups:
        spec = g.spec
        policy = policy_for(spec)
        if policy.holds_state:
            total += g.num_layers * spec.page_bytes
            continue
        role = role_of(spec, model)
        lo = group_length(role, first, image_tokens)
        hi = group_length(role, end, image_tokens)
        start = kept_interval(spec, lo, prompt_done)[0] if lo else 0
        if policy.prefill_only and prompt_done:
            start = hi
        total += g.num_layers * spec.bytes_per_token * (hi - min(start, hi))
    return total


def uniform_bytes(model: ModelSpec, n: int) -> int:
    """Bytes uniform paging holds: every layer stores every one of the ``n`` tokens."""
    return n * sum(g.num_layers * g.spec.bytes_per_token for g in model.groups)


def uniform_waste(model: ModelSpec, n: int, image_tokens: int = 0) -> float:
    """Share of uniform paging's memory no future step reads (exact, block size 1)."""
    held = uniform_bytes(model, n)
    return 1.0 - needed_bytes(model, n, image_tokens) / held if held else 0.0
