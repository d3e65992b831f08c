"""Backend tests: the shared conformance suite and backend-specific tests."""
