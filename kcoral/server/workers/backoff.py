# -*- test-case-name: tests.unit.test_spares -*-
"""
How long to wait before trying again what failed several times in a row: a
worker replacement, a warm spare's start, a worker template's restart.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class Backoff:
    """
    A doubling wait: C{initial} after the first failure in a row, twice that
    after the second, and so on, never more than C{maximum}.
    """

    initial: float = 0.5
    maximum: float = 60.0

    def delay(self, failures: int) -> float:
        """The wait after C{failures} (1 or more) failures in a row."""
        return min(self.initial * 2 ** max(failures - 1, 0), self.maximum)
