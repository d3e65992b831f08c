"""Omni connectors: transport backends behind one small interface.

Backends register themselves by name in :class:`OmniConnectorFactory`; the
built-in names are resolved lazily so an optional backend's missing package
only matters when that backend is created.
"""
