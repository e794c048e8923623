"""The package version, importable from any layer (it imports nothing)."""

__version__ = "0.1.0"
