"""The 0.1.1 client's module path for C{ProgramResult} (kept for its scripts)."""

from kcoral.client.results import ProgramResult

__all__ = ["ProgramResult"]
