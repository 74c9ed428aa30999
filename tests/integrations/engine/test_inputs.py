"""Inputs the engine and the HF cache refuse at the call, with what was wrong in the
message; a refused request leaves the engine serving the others."""

from __future__ import annotations

from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

import numpy as np  # noqa: E402

from integrations.engine import EngineConfig, MiniEngine  # noqa: E402
from integrations.hf import VmmCache  # noqa: E402
from tests.integrations.engine.test_engine import CHUNK, reference, tiny  # noqa: E402


@pytest.fixture(scope="module")
def engine_model() -> Any:
    return tiny("llama")  # vocab 128, 512 positions


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"token_budget": 0}, "token_budget must be an int > 0, got 0"),
        ({"token_budget": -8}, "token_budget must be an int > 0, got -8"),
        ({"max_running": 0}, "max_running must be an int > 0, got 0"),
        ({"budget_bytes": 0}, "budget_bytes must be an int > 0, got 0"),
        ({"block_size": 2.5}, "block_size must be an int > 0, got 2.5"),
        ({"checkpoint_interval": 0}, "checkpoint_interval must be an int > 0"),
        ({"attention": "fast"}, "attention must be 'sdpa' or 'flash', got 'fast'"),
        ({"backend": "gpu"}, "backend must be 'host', 'cuda' or 'auto', got 'gpu'"),
        ({"budget_bytes": 8192, "max_bytes": 4096}, "max_bytes must be None or an int >= "),
    ],
)
def test_engine_config_refuses_at_construction(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


@pytest.mark.parametrize(
    ("rid", "prompt", "new", "error", "message"),
    [
        ("x", [1, 128], 4, ValueError, r"prompt\[1\] is 128, token ids must be ints in \[0, 128\)"),
        ("x", [1, -1], 4, ValueError, r"prompt\[1\] is -1"),
        ("x", [1, 2.0], 4, ValueError, r"prompt\[1\] is 2.0"),
        ("x", [True], 4, ValueError, r"prompt\[0\] is True"),
        ("x", [], 4, ValueError, "the prompt must hold >= 1 token id"),
        ("x", "abc", 4, ValueError, "the prompt must hold >= 1 token id"),
        ("x", [1] * 510, 4, ValueError, "510 prompt \\+ 4 new tokens exceed the model's 512"),
        ("x", [1, 2], 2.5, ValueError, "max_new_tokens must be an int >= 1, got 2.5"),
        ("x", [1, 2], 0, ValueError, "max_new_tokens must be an int >= 1, got 0"),
        (["x"], [1, 2], 4, TypeError, r"request id \['x'\] is not hashable"),
        ("r0", [1, 2], 4, ValueError, "request 'r0' was already added"),
    ],
)
def test_add_request_refuses_at_the_call_and_the_engine_keeps_serving(
    engine_model: Any, rid: Any, prompt: Any, new: Any, error: type, message: str
) -> None:
    engine = MiniEngine(engine_model, EngineConfig(budget_bytes=64 * CHUNK, chunk_bytes=CHUNK))
    engine.add_request("r0", [5, 6, 7], 3)
    with pytest.raises(error, match=message):
        engine.add_request(rid, prompt, new)
    assert engine.run() == reference(engine_model, [("r0", [5, 6, 7], 3, 0)])
    engine.close()


def test_numpy_token_ids_are_taken_as_ints(engine_model: Any) -> None:
    engine = MiniEngine(engine_model, EngineConfig(budget_bytes=64 * CHUNK, chunk_bytes=CHUNK))
    engine.add_request("r0", np.array([5, 6, 7]), 3)
    assert engine.run() == reference(engine_model, [("r0", [5, 6, 7], 3, 0)])
    engine.close()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"budget_bytes": 0}, "budget_bytes must be an int > 0, got 0"),
        ({"max_length": 0}, "max_length must be an int > 0, got 0"),
        ({"max_length": -5}, "max_length must be an int > 0, got -5"),
        ({"chunk_bytes": 0}, "chunk_bytes must be an int > 0, got 0"),
        ({"budget_bytes": 65537}, "budget_bytes 65537 is not a multiple of chunk_bytes 65536"),
    ],
)
def test_vmm_cache_refuses_bad_sizes_at_construction(
    engine_model: Any, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        VmmCache(engine_model.config, **kwargs)
