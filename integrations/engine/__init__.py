"""A mini continuous-batching engine over the jenga-driven vmm KV cache (imports torch)."""

from vmm.extras import require

require("torch", "integrations.engine (the mini engine)", extra="hf")
require("transformers", "integrations.engine (the mini engine)", extra="hf")

from integrations.engine.engine import EngineConfig, EngineRequest, MiniEngine  # noqa: E402
from integrations.engine.forward import PackedForward, Segment  # noqa: E402
from integrations.engine.model_forward import ModelForward  # noqa: E402

__all__ = [
    "EngineConfig",
    "EngineRequest",
    "MiniEngine",
    "ModelForward",
    "PackedForward",
    "Segment",
]
