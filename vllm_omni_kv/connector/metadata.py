"""What the scheduler half tells the worker half each step, and what comes back.

Plain dataclasses of strings, ints and lists: vLLM ships them between its own
processes together with the scheduler output.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import xxhash

from vllm_omni_kv.connector.vllm_bases import KVConnectorMetadata, KVConnectorWorkerMetadata

_UNSAFE = re.compile(r"[^A-Za-z0-9.\-]")


def transfer_id(engine_id: str, request_id: str) -> str:
    """The id a producer stores one request's KV under (unique across engines)."""
    return _UNSAFE.sub("-", f"{engine_id}.{request_id}")


def prompt_digest(token_ids: list[int] | None) -> str:
    """A short digest of the prompt tokens: both sides must hold the same prompt."""
    h = xxhash.xxh3_64()
    for t in token_ids or ():
        h.update(int(t).to_bytes(4, "little", signed=True))
    return h.hexdigest()


@dataclass
class SaveSpec:
    """Producer: send the KV of the first ``num_tokens`` prompt tokens of a request.

    ``block_ids``: the first transfer group's blocks. ``group_block_ids``: with several
    KV cache groups (vLLM's hybrid KV cache manager), every transfer group's blocks,
    those the consumer does not keep (outside a window) as the null block 0; None for
    a model with one group.
    """

    req_id: str
    transfer_id: str
    block_ids: list[int]
    num_tokens: int
    prompt_digest: str
    group_block_ids: list[list[int]] | None = None

    def tables(self) -> list[list[int]]:
        """Every transfer group's block table (one for a single-group model)."""
        return self.group_block_ids if self.group_block_ids is not None else [self.block_ids]


@dataclass
class LoadSpec:
    """Consumer: receive a remote prefill's KV into local blocks.

    Tokens ``[num_local_tokens, num_local_tokens + num_load_tokens)`` of the
    prompt are written into ``block_ids[num_local_tokens // block_size:]``;
    the first ``num_local_tokens`` are already cached locally. With several KV cache
    groups ``group_block_ids`` holds every transfer group's table as vLLM allocated it
    (null blocks, id 0, where a group keeps nothing) and ``block_ids`` the first's.
    """

    req_id: str
    transfer_id: str
    block_ids: list[int]
    num_local_tokens: int
    num_load_tokens: int
    num_prompt_tokens: int
    prompt_digest: str
    source_tp_size: int | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    group_block_ids: list[list[int]] | None = None

    def tables(self) -> list[list[int]]:
        """Every transfer group's block table (one for a single-group model)."""
        return self.group_block_ids if self.group_block_ids is not None else [self.block_ids]


@dataclass
class RemotePayload:
    """Consumer: where a request's remote payload is (discarded when a local prefix hit
    makes it unneeded, or its lease extended while the request waits for blocks)."""

    req_id: str
    transfer_id: str
    source_tp_size: int | None = None
    remote_host: str | None = None
    remote_port: int | None = None


@dataclass
class OmniKVConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker: this step's saves, loads, discards and lease extensions.

    ``idle``: the step schedules no tokens (no forward pass), so the worker may wait
    for transfers in flight. Set by the scheduler because the model runners differ in
    what a connector sees: vLLM's V2 runner starts loads after the forward with no
    attention metadata on every step.
    """

    saves: list[SaveSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    discards: list[RemotePayload] = field(default_factory=list)
    # remote payloads of requests still waiting here: extend their producer-side leases
    extends: list[RemotePayload] = field(default_factory=list)
    # saved requests that finished without a handoff (aborted): nobody reads their payload
    withdraws: list[str] = field(default_factory=list)
    # saved requests vLLM preempted (their blocks were freed): their payloads are void
    preempted: list[str] = field(default_factory=list)
    idle: bool = False

    def is_empty(self) -> bool:
        return not (
            self.saves
            or self.loads
            or self.discards
            or self.extends
            or self.withdraws
            or self.preempted
        )


@dataclass
class OmniKVWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler: per-request outcome of finished loads.

    ``loads`` maps a request id to ``{"ok", "tokens", "bytes", "seconds", "error"}``.
    """

    loads: dict[str, dict[str, Any]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, OmniKVWorkerMetadata):
            return self
        merged = {k: dict(v) for k, v in self.loads.items()}
        for req_id, res in other.loads.items():
            mine = merged.get(req_id)
            merged[req_id] = dict(res) if mine is None else merge_load(mine, res)
        return OmniKVWorkerMetadata(loads=merged)


def merge_load(mine: dict[str, Any], res: dict[str, Any]) -> dict[str, Any]:
    """Two TP ranks' outcomes of one load, in one step or in two (a rank's output can
    reach the scheduler a step late): the request loaded only if every rank did."""
    out = dict(mine)
    out["ok"] = bool(mine.get("ok")) and bool(res.get("ok"))
    out["bytes"] = int(mine.get("bytes", 0)) + int(res.get("bytes", 0))
    out["seconds"] = max(float(mine.get("seconds", 0)), float(res.get("seconds", 0)))
    out["tokens"] = min(int(mine.get("tokens", 0)), int(res.get("tokens", 0)))
    if res.get("error") and not mine.get("error"):
        out["error"] = res["error"]
    return out
