"""The 0.1.1 client's module path for remote functions (kept for its scripts)."""

from kcoral.client.errors import RemoteExecutionError
from kcoral.client.remote import RemoteFunction

__all__ = ["RemoteExecutionError", "RemoteFunction"]
