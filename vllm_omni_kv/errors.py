"""The one exception hierarchy of vllm-omni-kv."""

from __future__ import annotations


class OmniKVError(Exception):
    """Base class of every error raised by vllm-omni-kv."""


class ConfigError(OmniKVError, ValueError):
    """A configuration value is missing, of the wrong type, or out of range."""


class KVPayloadError(OmniKVError, ValueError):
    """A packed KV payload is malformed, truncated, or fails its checksum."""


class KVTransferError(OmniKVError, RuntimeError):
    """A transfer failed (peer gone, send rejected, pool exhausted...)."""


class KVTransferTimeout(KVTransferError, TimeoutError):
    """A transfer did not complete within its deadline."""


class BackendUnavailable(OmniKVError, ImportError):
    """A backend cannot be used here (package missing, service unreachable)."""


class KVTransferCancelled(KVTransferError):
    """A transfer was stopped because its request was aborted."""
