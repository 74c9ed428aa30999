"""Turning jenga on in vLLM with one setting: the ``jenga_vmm`` key of ``additional_config``.

Rationale
    ``vllm serve MODEL --additional-config '{"jenga_vmm": {...}}'`` is the whole opt-in:
    the user should not also have to name a scheduler class, and the class must match
    vLLM's scheduling mode (vLLM 0.32 and 0.33 schedule asynchronously by default; the
    sync `JengaScheduler` under async scheduling would run, but degraded).

Approach
    The ``vllm.general_plugins`` entry point (`integrations.vllm.plugin.register`) wraps
    two vLLM methods, once per process:
    - ``VllmConfig.__post_init__``: after vLLM's own (which settles ``async_scheduling``,
      the platform hook having the last word), `choose_scheduler` sets
      ``scheduler_config.scheduler_cls`` to `JengaAsyncScheduler` or `JengaScheduler`
      when the ``jenga_vmm`` key is present and no scheduler class was given, and swaps
      ours for its twin when the given one does not match the mode (the older
      ``--scheduler-cls integrations.vllm.scheduler.JengaScheduler`` spelling).
    - ``SchedulerConfig.get_scheduler_cls``: the same swap where the class is read (the
      engine core process), for a config built before the plugin was loaded.
    vLLM loads general plugins in ``EngineArgs`` before it builds the config, so
    ``vllm serve`` and ``LLM(...)`` see the wrapped ``__post_init__``.

Limitations
    A scheduler class other than ours is left alone: a user's own class wins over the key.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from integrations.vllm.options import OPTIONS_KEY

_log = logging.getLogger(__name__)
_MARK = "_jenga_vmm_wrapped"
_MODULE = "integrations.vllm.scheduler"
#: async_scheduling -> the scheduler class vLLM must build
SCHEDULERS = {False: f"{_MODULE}.JengaScheduler", True: f"{_MODULE}.JengaAsyncScheduler"}


def jenga_requested(vllm_config: Any) -> bool:
    """Whether ``additional_config`` holds the ``jenga_vmm`` key (the one opt-in)."""
    extra = getattr(vllm_config, "additional_config", None)
    return isinstance(extra, dict) and OPTIONS_KEY in extra


def _qualname(value: object) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    return None


def scheduler_for(current: object, async_scheduling: bool, requested: bool) -> str | None:
    """The scheduler class name vLLM should build, or None to leave `current` as it is:
    ours for the mode when `requested` and no class was given, or when `current` is our
    class for the other mode."""
    wanted = SCHEDULERS[bool(async_scheduling)]
    if current is None:
        return wanted if requested else None
    name = _qualname(current)
    if name in SCHEDULERS.values() and name != wanted:
        return wanted
    return None


def choose_scheduler(vllm_config: Any) -> None:
    """Set ``scheduler_config.scheduler_cls`` to jenga's class for the scheduling mode."""
    sched = vllm_config.scheduler_config
    name = scheduler_for(sched.scheduler_cls, sched.async_scheduling, jenga_requested(vllm_config))
    if name is not None:
        _log.info("jenga-vmm: vLLM builds %s", name)
        sched.scheduler_cls = name


def _wrap_post_init(config_cls: type) -> None:
    original: Callable[[Any], None] = config_cls.__post_init__  # type: ignore[attr-defined]
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def __post_init__(self: Any) -> None:
        original(self)
        choose_scheduler(self)

    setattr(__post_init__, _MARK, True)
    config_cls.__post_init__ = __post_init__  # type: ignore[attr-defined]


def _wrap_get_scheduler_cls(scheduler_config_cls: type) -> None:
    original: Callable[[Any], type] = scheduler_config_cls.get_scheduler_cls  # type: ignore[attr-defined]
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def get_scheduler_cls(self: Any) -> type:
        cls = original(self)
        name = scheduler_for(cls, self.async_scheduling, requested=False)
        if name is None:
            return cls
        from integrations.vllm import scheduler

        twin: type = getattr(scheduler, name.rpartition(".")[2])
        return twin

    setattr(get_scheduler_cls, _MARK, True)
    scheduler_config_cls.get_scheduler_cls = get_scheduler_cls  # type: ignore[attr-defined]


def install() -> None:
    """Wrap vLLM's config classes once (called by the plugin's `register`)."""
    from integrations.vllm import compat

    classes = compat.config_classes()
    _wrap_post_init(classes["VllmConfig"])
    _wrap_get_scheduler_cls(classes["SchedulerConfig"])
