"""A mini continuous-batching engine over the jenga-driven vmm KV cache (imports torch)."""

from integrations.engine.engine import EngineConfig, EngineRequest, MiniEngine
from integrations.engine.forward import PackedForward, Segment

__all__ = ["EngineConfig", "EngineRequest", "MiniEngine", "PackedForward", "Segment"]
