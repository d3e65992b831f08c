"""Hostile ``kv_transfer_params``: every field parsed by one strict schema; anything off
makes the request compute locally instead of raising into vLLM's scheduler or making
the consumer allocate per client-chosen number."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_omni_kv.connector.config import parse_omni_kv_config
from vllm_omni_kv.connector.metadata import transfer_id
from vllm_omni_kv.connector.remote_params import (
    MAX_BLOCK_GROUPS,
    MAX_BLOCK_IDS,
    MAX_TP_SIZE,
    RemoteParamsError,
    parse_remote_params,
)
from vllm_omni_kv.connector.scheduler import OmniKVScheduler

GOOD = {
    "do_remote_prefill": True,
    "remote_engine_id": "producer-0",
    "remote_request_id": "cmpl-1",
    "remote_host": "127.0.0.1",
    "remote_port": 15000,
    "tp_size": 1,
}


def _consumer(tp: int = 1) -> OmniKVScheduler:
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(is_kv_producer=False, is_kv_consumer=True),
        cache_config=SimpleNamespace(block_size=32),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
    )
    return OmniKVScheduler(vllm_config, parse_omni_kv_config({}), "consumer")  # type: ignore[arg-type]


def _request(params: dict[str, Any]) -> SimpleNamespace:
    return SimpleNamespace(
        request_id="r1",
        kv_transfer_params=params,
        num_prompt_tokens=200,
        prompt_token_ids=[1] * 200,
    )


def test_good_params_parse_and_the_transfer_id_is_derived() -> None:
    got = parse_remote_params({**GOOD, "remote_transfer_id": "../../etc/passwd"}, 1)
    assert (got.host, got.port, got.tp_size) == ("127.0.0.1", 15000, 1)
    assert got.transfer_id == transfer_id("producer-0", "cmpl-1")  # never the client's


# What an HTTP client can send in plain JSON (json.loads accepts Infinity and NaN).
HOSTILE = [
    ("remote_port", json.loads("Infinity")),
    ("remote_port", -math.inf),
    ("remote_port", math.nan),
    ("remote_port", -1),
    ("remote_port", 65536),
    ("remote_port", 80.5),
    ("remote_port", True),
    ("remote_port", "eighty"),
    ("remote_port", [15000]),
    ("tp_size", json.loads("Infinity")),
    ("tp_size", 10**7),
    ("tp_size", MAX_TP_SIZE + 1),
    ("tp_size", 0),
    ("tp_size", 3),  # neither divides nor is a multiple of TP 2
    ("remote_engine_id", ""),
    ("remote_engine_id", 7),
    ("remote_engine_id", "x" * 10_000),
    ("remote_request_id", "r\x00\n1"),
    ("remote_request_id", None),
    ("remote_host", "host name with spaces"),
    ("remote_host", "h" * 1000),
    ("remote_host", {"h": 1}),
    ("remote_block_ids", "1,2,3"),
    ("remote_block_ids", {"0": [1]}),
    ("remote_block_ids", [1, "2"]),
    ("remote_block_ids", [1, True]),
    ("remote_block_ids", [-1]),
    ("remote_block_ids", [2**31]),
    ("remote_block_ids", [1.0]),
    ("remote_block_ids", [[1], 2]),
    ("remote_block_ids", [[[1]]]),
    ("remote_block_ids", [[1], [json.loads("NaN")]]),
    ("remote_block_ids", [[0]] * (MAX_BLOCK_GROUPS + 1)),
    ("remote_block_ids", [0] * (MAX_BLOCK_IDS + 1)),
    ("remote_block_ids", [[0] * (MAX_BLOCK_IDS // 2), [0] * (MAX_BLOCK_IDS // 2 + 1)]),
]


@pytest.mark.parametrize(("field", "value"), HOSTILE, ids=lambda v: repr(v)[:20])
def test_a_hostile_field_is_refused_and_the_request_computes_locally(
    field: str, value: Any
) -> None:
    params = {**GOOD, "tp_size": 2, field: value}
    with pytest.raises(RemoteParamsError):
        parse_remote_params(params, 2)
    sched = _consumer(tp=2)
    request = _request(params)
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)  # type: ignore[arg-type]
    assert sched.request_finished(request, []) == (False, None)  # type: ignore[arg-type]
    assert not sched._discards, "a refused request named a payload"


@pytest.mark.parametrize(
    ("value", "groups"),
    [
        ([[3, 4, 5]], ((3, 4, 5),)),  # vLLM's shape: one list per KV cache group
        ([[0, 0, 7], [5, 6, 7]], ((0, 0, 7), (5, 6, 7))),  # two groups, nulls before a window
        ([3, 4, 5], ((3, 4, 5),)),  # a vLLM 0.32-era producer's flat list: one group
        ([], ((),)),
        (None, None),  # absent
    ],
)
def test_remote_block_ids_in_either_shape_are_read_per_group(value: Any, groups: Any) -> None:
    assert parse_remote_params({**GOOD, "remote_block_ids": value}, 1).block_ids == groups


def test_port_zero_means_no_side_channel() -> None:
    assert parse_remote_params({**GOOD, "remote_port": 0}, 1).port is None  # what shm sends


def test_numbers_as_strings_and_whole_floats_are_accepted() -> None:
    got = parse_remote_params({**GOOD, "remote_port": "15000", "tp_size": 2.0}, 1)
    assert (got.port, got.tp_size) == (15000, 2)


def test_a_valid_request_loads() -> None:
    sched = _consumer()
    assert sched.get_num_new_matched_tokens(_request(dict(GOOD)), 0) == (200, True)  # type: ignore[arg-type]
