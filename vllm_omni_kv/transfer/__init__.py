"""Transfer core usable by vLLM-free stages: payload codec, kv_utils, manager, config."""
