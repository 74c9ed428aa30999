"""A mini continuous-batching engine over the jenga-driven vmm KV cache (imports torch)."""

from integrations.engine.engine import EngineConfig, EngineRequest, MiniEngine
from integrations.engine.forward import PackedForward, Segment
from integrations.engine.model_forward import ModelForward

__all__ = [
    "EngineConfig",
    "EngineRequest",
    "MiniEngine",
    "ModelForward",
    "PackedForward",
    "Segment",
]
