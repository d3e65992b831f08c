"""The transfer layer: the transfer session, ``OmniKVTransferManager`` and its config.

Usable without vLLM; above the backends, below the vLLM connector.
"""
