"""Shared-memory backend: producer arena, reader, connector."""
