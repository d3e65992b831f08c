"""Helpers for tests, demos and benchmarks (tiny deterministic models, free ports)."""
