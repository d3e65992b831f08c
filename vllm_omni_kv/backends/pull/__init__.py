"""Pull-based transfer-engine backends (Mooncake TE, Yuanrong TE) over one shared base:
a registered pool, a TCP side channel with leases, synchronous pulls; and the registered
KV cache (``register_cache``) that Mooncake TE and NIXL share."""
