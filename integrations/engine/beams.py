"""Beam search for the mini engine: the beams of one request share blocks (`KVCache.fork`).

Rationale
    Beam search keeps ``k`` continuations of one prompt; after each token the best ``k``
    of all ``k x vocab`` extensions survive, so several new beams often continue one old
    beam and some old beams die. Stored naively every beam holds its own copy of the
    prompt and of the common history; with forks a beam that continues another shares
    every block of it and copies only the block its next token writes into.

Approach
    A request with ``beams=k`` runs as beam 0 until its prompt is computed. Every beam is
    an ordinary engine request (scheduled, preempted and recomputed like any other); when
    a beam's forward reaches the end of its sequence its last logits wait in the
    `BeamGroup` until every beam of the group has them. Then one `BeamGroup.select` does
    what transformers' beam search does for a batch of one, with the same torch ops so
    the choice is the same (fp32 ``log_softmax`` of the logits plus each beam's running
    score, the top ``2k`` of the flattened ``k x vocab`` scores, the top ``k`` of those);
    the first selection reads the prompt's logits as ``k`` identical rows (beams 1..k-1
    start at -1e9, as in transformers). The engine then remaps the beams: the first new
    beam that continues an old one takes its request over, every other one forks it, an
    old beam no new one continues is freed.

    Without an end-of-sequence token no beam finishes early, so the last selection's
    first ``k`` candidates are transformers' ``k`` best sequences in order
    (``num_return_sequences=k``; length penalty divides every score by the same length).

Limitations
    Greedy beam search only (no beam sampling, length penalty or early stopping by EOS);
    the engine refuses beams with a seed, with ``n``, with ``overlap`` or images, and more
    beams than ``max_running`` (a group must be able to run at once). A Mamba state is
    forked like a partly filled block: each beam copies it on its first step.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class BeamChoice:
    """New beam i continues old beam ``sources[i]`` with token ``tokens[i]``."""

    sources: list[int]
    tokens: list[int]


@dataclass
class BeamGroup:
    """The live beams of one request and their running scores."""

    request_id: Hashable
    width: int
    max_new_tokens: int
    order: int = 0  # the engine's `add_request` order (older groups go first)
    beams: list[Hashable] = field(default_factory=list)  # engine request ids, beam order
    scores: torch.Tensor | None = None
    logits: dict[Hashable, torch.Tensor] = field(default_factory=dict)
    _next: int = 0

    def __post_init__(self) -> None:
        self.scores = torch.zeros(self.width, dtype=torch.float32)
        self.scores[1:] = -1e9
        self.beams = [self.new_id()]

    def new_id(self) -> Hashable:
        """A fresh engine request id for a beam."""
        rid = (self.request_id, "beam", self._next)
        self._next += 1
        return rid

    def stash(self, beam_id: Hashable, logits: torch.Tensor) -> None:
        self.logits[beam_id] = logits.to(copy=True, dtype=torch.float32)

    @property
    def ready(self) -> bool:
        return all(b in self.logits for b in self.beams)

    def select(self) -> BeamChoice:
        """One step of transformers' beam search (batch of one, no EOS): the top ``2k``
        extensions by accumulated log-probability, the top ``k`` of them continue."""
        k = self.width
        rows = [self.logits[b] for b in self.beams]
        if len(rows) == 1:  # after the prompt: k identical rows, as transformers expands
            rows = rows * k
        self.logits.clear()
        log_probs = torch.nn.functional.log_softmax(torch.stack(rows), dim=-1)
        vocab = log_probs.shape[-1]
        assert self.scores is not None
        log_probs = (log_probs + self.scores[:, None]).reshape(1, -1)
        top_scores, top_indices = torch.topk(log_probs, k=2 * k)
        keep = torch.topk(top_scores, k=k)[1]
        self.scores = torch.take_along_dim(top_scores, keep, dim=1)[0]
        chosen = torch.take_along_dim(top_indices, keep, dim=1)[0]
        return BeamChoice((chosen // vocab).tolist(), (chosen % vocab).tolist())
