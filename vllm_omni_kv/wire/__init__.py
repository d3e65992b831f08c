"""The wire layer: the packed frame codec, frame streams and ``KVCacheTransferData``.

Imports nothing above it (no backend, session or vLLM code).
"""
