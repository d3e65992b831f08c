"""CUDA IPC backend: stages on one host copy KV pages GPU to GPU from the producer cache."""
