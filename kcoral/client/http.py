"""The 0.1.1 client's module path for C{Client} (kept for its scripts)."""

from kcoral.client.blocking import Client

__all__ = ["Client"]
