"""AR stage: a vLLM engine (producer) prefills the prompt and its negative prompt and
hands their KV to the diffusion stage through OmniKVConnector.

Prints one line ``READY {"positive": id, "negative": id, ...}`` and keeps the engine
(which owns the shared-memory arena) alive until a line arrives on stdin.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--negative", required=True)
    ap.add_argument("--namespace", default="ar2dit")
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(
        kv_connector="OmniKVConnector",
        kv_role="kv_producer",
        kv_connector_extra_config={
            "backend": "shm",
            "backend_extra": {"namespace": a.namespace},
            "omni_from_stage": "ar",
            "omni_to_stage": "dit",
        },
    )
    llm = LLM(
        model=a.model,
        dtype=a.dtype,
        max_model_len=1024,
        block_size=32,
        enforce_eager=True,
        seed=0,
        kv_transfer_config=ktc,
        gpu_memory_utilization=0.5,
    )
    sp = SamplingParams(
        temperature=0, max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}}
    )
    t0 = time.perf_counter()
    outs = llm.generate([a.prompt, a.negative], sp)
    prefill_s = time.perf_counter() - t0
    ids = []
    for o in outs:
        params = o.kv_transfer_params or {}
        if "remote_transfer_id" not in params:
            print(
                f"ERROR: the producer returned no transfer id for {o.request_id}: {params}",
                file=sys.stderr,
            )
            sys.exit(1)
        ids.append(params["remote_transfer_id"])  # the key the KV was published under
    info = {
        "positive": ids[0],
        "negative": ids[1],
        "prompt_tokens": [len(o.prompt_token_ids or []) for o in outs],
        "prefill_s": prefill_s,
        "sent_at": time.time(),
    }
    print("READY " + json.dumps(info), flush=True)
    sys.stdin.readline()  # the diffusion stage has its KV: release the engine
