"""Mooncake Store backend and a loopback ``mooncake_master`` launcher."""
