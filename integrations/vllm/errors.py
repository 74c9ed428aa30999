"""The vLLM integration's own exceptions, one base class for all of them.

Every refusal names the numbers or the feature involved; callers catch `JengaVllmError`
for any of them, or the `NotImplementedError` / `ValueError` side a subclass also has.
"""

from __future__ import annotations


class JengaVllmError(Exception):
    """Base class of the vLLM integration's own errors."""


class UnsupportedLayerKind(JengaVllmError, NotImplementedError):
    """A KV-cache spec jenga cannot manage in this integration."""


class UnsupportedFeature(JengaVllmError, NotImplementedError):
    """A vLLM feature (connector, speculative decoding, ...) this manager does not serve."""


class InvalidOptions(JengaVllmError, ValueError):
    """``additional_config["jenga_vmm"]`` holds an unknown key or a bad value."""


class InvalidTruncation(JengaVllmError, AssertionError):
    """A prefix hit cut where vLLM's manager asserts: off a group's block grid, or past
    the blocks a (non-Mamba) group holds."""
