"""One setting turns jenga on in vLLM: the ``jenga_vmm`` key of ``additional_config``. The
plugin (loaded through vLLM's own entry-point loader) picks the scheduler class for vLLM's
scheduling mode; vLLM's real `EngineCore` then runs under async scheduling, its default."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.conftest import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

from integrations.vllm.activation import SCHEDULERS, scheduler_for
from integrations.vllm.harness import engine, replay
from integrations.vllm.scheduler import JengaAsyncScheduler, JengaScheduler

from integrations.vllm import compat

SYNC, ASYNC = SCHEDULERS[False], SCHEDULERS[True]


@pytest.mark.parametrize(
    ("current", "is_async", "requested", "expected"),
    [
        (None, True, True, ASYNC),  # the key alone, vLLM's default mode
        (None, False, True, SYNC),
        (None, True, False, None),  # no key: vLLM's own scheduler
        (SYNC, True, False, ASYNC),  # the old spelling under async scheduling
        (JengaScheduler, True, True, ASYNC),  # a class object, not a name
        (ASYNC, False, True, SYNC),
        (SYNC, False, True, None),  # already right
        ("my.own.Scheduler", True, True, None),  # a user's class wins over the key
    ],
)
def test_scheduler_for_the_mode(
    current: Any, is_async: bool, requested: bool, expected: Any
) -> None:
    assert scheduler_for(current, is_async, requested) == expected


def engine_request(rid: str, prompt: list[int]) -> Any:
    """A 5-token greedy request for vLLM's `EngineCore` (no multimodal, LoRA, salt)."""
    return compat.greedy_engine_request(rid, prompt, 5)


def _vllm_default_config(model_dir: Path, options: dict[str, Any] | None) -> Any:
    """A config with async scheduling left to vLLM (its default) and ``options`` under the
    ``jenga_vmm`` key (None: no key)."""
    setup = replay.SchedulerSetup(max_model_len=1024, async_scheduling=None, jenga_options=options)
    return replay.make_vllm_config(model_dir, setup)


@pytest.mark.parametrize("kv_tensors", ["torch", "vmm"])
def test_the_key_alone_runs_vllms_engine_core_under_async_scheduling(
    model_dir: Path, kv_tensors: str
) -> None:
    compat.load_general_plugins()  # as vLLM's EngineArgs and EngineCore do
    config = _vllm_default_config(model_dir, {"kv_tensors": kv_tensors})
    assert config.scheduler_config.async_scheduling is True  # vLLM's default, untouched
    assert config.scheduler_config.scheduler_cls == ASYNC
    core = compat.engine_core_class()(
        config, engine.host_executor_class("gemma2", 48 << 20), log_stats=True
    )
    assert type(core.scheduler) is JengaAsyncScheduler
    assert core.batch_queue is not None  # the async step (step_with_batch_queue)
    manager = core.scheduler.kv_cache_manager
    assert type(manager).__name__ == "JengaKVCacheManager"
    for i in range(3):
        request = engine_request(f"r{i}", [7] * 100 + [i + 1] * 50)
        core.add_request(*core.preprocess_add_request(request))
    finished: set[str] = set()
    for _ in range(80):
        outputs, _ = core.step_fn()
        for batch in (outputs or {}).values():
            finished.update(o.request_id for o in batch.outputs if o.finished)
        if finished == {"r0", "r1", "r2"}:
            break
    assert finished == {"r0", "r1", "r2"}
    assert manager.stats()["prefix.hit_tokens"] >= 2 * 96
    if kv_tensors == "vmm":
        assert core.model_executor.worker.kv_cache.mapped_bytes() > 0
    core.model_executor.shutdown()


def test_without_the_key_vllm_keeps_its_own_scheduler(model_dir: Path) -> None:
    compat.load_general_plugins()
    config = _vllm_default_config(model_dir, None)
    assert config.scheduler_config.async_scheduling is True
    assert config.scheduler_config.scheduler_cls is None
    assert config.scheduler_config.get_scheduler_cls() is compat.AsyncScheduler


def test_the_old_scheduler_cls_spelling_gets_the_class_for_the_mode(model_dir: Path) -> None:
    compat.load_general_plugins()
    config = _vllm_default_config(model_dir, None)
    sched = config.scheduler_config
    sched.scheduler_cls = SYNC  # the sync class named, async scheduling on
    assert sched.get_scheduler_cls() is JengaAsyncScheduler
    sched.async_scheduling = False
    assert sched.get_scheduler_cls() is JengaScheduler
