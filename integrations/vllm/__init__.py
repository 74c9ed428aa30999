"""jenga-vmm inside vLLM 0.32 and 0.33: a jenga-backed KV-cache manager and VMM-backed KV tensors.

Importing this package needs vLLM installed and changes nothing in vLLM. It is turned
on explicitly, never by import side effects:

- scheduler side: ``--scheduler-cls integrations.vllm.scheduler.JengaScheduler``
  (``JengaAsyncScheduler`` with async scheduling), options in
  ``additional_config={"jenga_vmm": {...}}``;
- worker side: the ``vllm.general_plugins`` entry point runs `plugin.register`, which
  checks the version and does nothing else unless ``additional_config["jenga_vmm"]``
  has ``"kv_tensors": "vmm"`` (see `integrations.vllm.kv_tensors`).
"""

from __future__ import annotations

from integrations.vllm.version import SUPPORTED_VLLM_VERSIONS, check_vllm_version

__all__ = ["SUPPORTED_VLLM_VERSIONS", "check_vllm_version"]
