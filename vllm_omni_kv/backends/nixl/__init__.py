"""NIXL backend: the pull connector's protocol with NIXL agents (UCX) moving the bytes."""
