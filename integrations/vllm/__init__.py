"""jenga-vmm inside vLLM 0.32 and 0.33: a jenga-backed KV-cache manager and VMM-backed KV tensors.

Importing this package needs vLLM installed and changes nothing in vLLM. It is turned
on by one setting, the ``jenga_vmm`` key of vLLM's ``additional_config``
(``vllm serve MODEL --additional-config '{"jenga_vmm": {}}'``; options inside it):

- scheduler side: the ``vllm.general_plugins`` entry point (`plugin.register`) makes
  vLLM build ``JengaAsyncScheduler`` under async scheduling (vLLM's default) and
  ``JengaScheduler`` otherwise (`integrations.vllm.activation`); the older
  ``--scheduler-cls integrations.vllm.scheduler.JengaScheduler`` spelling still works
  and gets the class for the mode;
- worker side: the same plugin checks the version and does nothing else unless
  ``additional_config["jenga_vmm"]`` has ``"kv_tensors": "vmm"`` (see
  `integrations.vllm.kv_tensors`).
"""

from __future__ import annotations

from integrations.vllm.version import SUPPORTED_VLLM_VERSIONS, check_vllm_version

__all__ = ["SUPPORTED_VLLM_VERSIONS", "check_vllm_version"]
