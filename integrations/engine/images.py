"""Image inputs of engine requests: computed once per request, fed per segment.

Rationale
    A chunked prefill or a prefix hit runs a request's prompt in pieces, but a vision
    model's forward takes its images whole (LLaVA-OneVision splices every image's
    features into the prompt's embeddings and checks their count against the image
    tokens; Mllama computes the cross-attention states of all images at once). So the
    engine runs the vision side once per request with the model's own methods, keeps the
    result beside the request, and hands each segment the slice it needs. The images
    also decide prefix identity: a block's hash covers the image content (jenga
    `ImageSpan.content_hash`), so two prompts with the same text and different images
    never share K/V.

Approach
    One adapter class per way a model takes images, picked by ``model_type``::

        llava_onevision  SplicedImages   prompt embeddings with image features spliced in
                                         (`get_image_features`, `get_placeholder_mask`,
                                         `masked_scatter`, as the model's forward does);
                                         a segment gets ``inputs_embeds[start:stop]``;
                                         each run of image tokens is an in-text ImageSpan
        mllama           CrossImages     cross-attention states (vision tower + projector,
                                         as `MllamaModel.forward`); the segment at position
                                         0 passes them and the cross layers write their
                                         K/V into the request's cross-attention blocks;
                                         later segments (and prefix hits) read those blocks

    Mllama's cross-attention layers change every text position, even those before the
    ``<|image|>`` token: transformers zeroes a fully masked row's attention bias, so such
    a row attends uniformly to all image tokens and adds that to the residual (only the
    MLP part is masked out). The image span is therefore registered at position 0
    (``in_text=False``): every block's hash, from the first, covers the images, and the
    cross blocks are allocated with the first segment. Rows of ``cross_attention_mask``
    past the prompt repeat its last row, as `generate` extends it.

    `content_hash` hashes the image inputs (names, dtypes, shapes, bytes) with BLAKE2b.
    Mllama's ``cross_attention_mask`` changes the K/V too but is left out: it must be the
    one `MllamaProcessor` builds from the prompt's tokens and the images' tiles (checked),
    so the tokens and the hashed images determine it.

Limitations
    Two image paths (LLaVA-OneVision, Mllama); other vision models are refused by the
    engine. Image features live in host/device memory beside the request until it
    finishes (not in jenga's vision-embedding group), and a vision tower runs once per
    request, even when another request holds the same image.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
from jenga.requests import ImageSpan

from integrations.engine.forward import Segment
from integrations.hf.compat import cross_mask_from_zero

SEQUENCE_INPUTS = frozenset({"input_ids", "inputs_embeds", "position_ids", "cross_attention_mask"})
"""Model inputs whose dimension 1 is the token position (sliced for one-token steps)."""


class RequestImages(Protocol):
    """A request's image inputs, prepared once: the spans that key its blocks, its
    cross-attention tokens (0 without cross attention) and each segment's model inputs."""

    spans: tuple[ImageSpan, ...]
    cross_tokens: int

    def inputs(self, seg: Segment, ids: torch.Tensor) -> dict[str, torch.Tensor]: ...


def content_hash(inputs: Mapping[str, Any]) -> int:
    """A 128-bit BLAKE2b digest of every input's name, dtype, shape and bytes (jenga keys
    blocks by the whole value: an image key is never cut to 64 bits)."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(inputs):
        value = inputs[name]
        h.update(name.encode())
        if isinstance(value, torch.Tensor):
            t = value.detach().to("cpu").contiguous().reshape(-1)
            h.update(f"{t.dtype}{tuple(value.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(value).encode())
    return int.from_bytes(h.digest(), "little")


def _batch_of_one(request_id: object, inputs: Mapping[str, Any]) -> None:
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] != 1:
            raise ValueError(
                f"request {request_id!r}: image input {name!r} has batch {value.shape[0]}; "
                "an engine request carries one row (processor(..., text=[one prompt]))"
            )


class SplicedImages:
    """Image features spliced into the prompt's embeddings (LLaVA-OneVision)."""

    cross_tokens = 0

    def __init__(
        self, model: Any, request_id: object, prompt: Sequence[int], inputs: Mapping[str, Any]
    ) -> None:
        base = model.model  # its placeholder mask checks image tokens against features
        device = next(model.parameters()).device
        ids = torch.tensor([list(prompt)], device=device)
        self.embed = base.get_input_embeddings()
        params = inspect.signature(base.get_image_features).parameters
        kwargs = {k: _maybe_to(v, device) for k, v in inputs.items() if k in params}
        if "pixel_values" not in kwargs:
            raise ValueError(
                f"request {request_id!r}: image inputs {sorted(inputs)} lack pixel_values"
            )
        with torch.no_grad():
            out = base.get_image_features(**kwargs, return_dict=True)
            embeds = self.embed(ids)
            features = torch.cat(out.pooler_output, dim=0).to(embeds.device, embeds.dtype)
            mask, _ = base.get_placeholder_mask(ids, inputs_embeds=embeds, image_features=features)
            self.prompt_embeds = embeds.masked_scatter(mask, features)
        key = content_hash(inputs)
        self.spans = tuple(
            ImageSpan(start, stop - start, content_hash=content_hash({"inputs": key, "image": i}))
            for i, (start, stop) in enumerate(_runs(prompt, model.config.image_token_id))
        )

    def inputs(self, seg: Segment, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """``inputs_embeds`` of the segment: the spliced prompt, then generated tokens."""
        num_prompt = self.prompt_embeds.shape[1]
        parts = [self.prompt_embeds[:, seg.start : min(seg.stop, num_prompt)]]
        if seg.stop > num_prompt:
            parts.append(self.embed(ids[:, max(0, num_prompt - seg.start) :]))
        return {"inputs_embeds": torch.cat(parts, dim=1)}


class CrossImages:
    """Cross-attention states of the request's images (Mllama)."""

    def __init__(
        self, model: Any, request_id: object, prompt: Sequence[int], inputs: Mapping[str, Any]
    ) -> None:
        _batch_of_one(request_id, inputs)
        missing = {"pixel_values", "aspect_ratio_ids", "cross_attention_mask"} - set(inputs)
        if missing:
            raise ValueError(f"request {request_id!r}: image inputs lack {sorted(missing)}")
        mask = inputs["cross_attention_mask"]
        _check_cross_mask(request_id, prompt, inputs, model.config.image_token_id)
        base = model.model
        device = next(model.parameters()).device
        with torch.no_grad():  # MllamaModel.forward's vision step
            vision = base.vision_model(
                pixel_values=inputs["pixel_values"].to(device),
                aspect_ratio_ids=inputs["aspect_ratio_ids"].to(device),
                aspect_ratio_mask=_maybe_to(inputs.get("aspect_ratio_mask"), device),
            ).last_hidden_state
            states = base.multi_modal_projector(vision)
            self.states = states.reshape(-1, vision.shape[-2], base.hidden_size)
        self.mask = mask.to(device)
        self.cross_tokens = self.states.shape[0] * self.states.shape[1]
        # the mask is the processor's function of the tokens and the images' tiles (checked)
        hashed = content_hash({k: v for k, v in inputs.items() if k != "cross_attention_mask"})
        self.spans: tuple[ImageSpan, ...] = (
            ImageSpan(0, self.cross_tokens, content_hash=hashed, in_text=False),
        )

    def inputs(self, seg: Segment, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """Token ids, the mask rows of the segment (from position 0 where the release's
        forward wants them: `cross_mask_from_zero`) and, at position 0, the states."""
        num_prompt = self.mask.shape[1]
        first = 0 if cross_mask_from_zero() else seg.start
        rows = self.mask[:, first : min(seg.stop, num_prompt)]
        if seg.stop > num_prompt:
            last = self.mask[:, -1:].expand(-1, seg.stop - max(first, num_prompt), -1, -1)
            rows = torch.cat([rows, last], dim=1)
        out = {"input_ids": ids, "cross_attention_mask": rows}
        if seg.start == 0:
            out["cross_attention_states"] = self.states
        return out


def _check_cross_mask(
    request_id: object, prompt: Sequence[int], inputs: Mapping[str, Any], image_token: int
) -> None:
    """`ValueError` unless ``cross_attention_mask`` is the one `MllamaProcessor` builds from
    the prompt's ``<|image|>`` tokens and each image's tiles (``aspect_ratio_mask``): prefix
    blocks are keyed by tokens and images, so the mask must follow from them."""
    from transformers.models.mllama.processing_mllama import (
        convert_sparse_cross_attention_mask_to_dense,
        get_cross_attention_token_mask,
    )

    mask = inputs["cross_attention_mask"]
    tiles = inputs.get("aspect_ratio_mask")
    if mask.dim() != 4 or mask.shape[1] != len(prompt) or tiles is None:
        raise ValueError(
            f"request {request_id!r}: cross_attention_mask {tuple(mask.shape)} must be "
            f"[1, {len(prompt)} prompt tokens, images, tiles], with aspect_ratio_mask"
        )
    expected = convert_sparse_cross_attention_mask_to_dense(
        [get_cross_attention_token_mask(list(prompt), image_token)],
        num_tiles=[[int(t) for t in tiles[0].sum(dim=-1)]],
        max_num_tiles=mask.shape[-1],
        length=len(prompt),
    )
    if expected.shape != tuple(mask.shape) or not (expected == mask.cpu().numpy()).all():
        raise ValueError(
            f"request {request_id!r}: cross_attention_mask is not MllamaProcessor's for these "
            f"tokens and images (shape {tuple(mask.shape)}, expected {expected.shape})"
        )


def _maybe_to(value: Any, device: Any) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _runs(prompt: Sequence[int], token: int) -> list[tuple[int, int]]:
    """[start, stop) of each maximal run of `token` in `prompt`."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, t in enumerate([*prompt, None]):
        if t == token and start is None:
            start = i
        elif t != token and start is not None:
            runs.append((start, i))
            start = None
    return runs


IMAGE_ADAPTERS: dict[str, Callable[..., RequestImages]] = {
    "llava_onevision": SplicedImages,
    "mllama": CrossImages,
}
"""model_type -> how the engine feeds that model's images."""
