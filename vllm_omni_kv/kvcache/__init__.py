"""Paged KV caches: layouts, block gather/scatter, TP topology and keys, and the two
payload formats (paged blocks, token-major). Above the wire layer, below the backends.
"""
