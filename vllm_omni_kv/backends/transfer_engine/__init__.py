"""Pull-based transfer-engine backends (Mooncake TE, Yuanrong TE) over one shared base:
a registered pool, a ZMQ side channel with leases, synchronous pulls."""
