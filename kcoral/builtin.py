# -*- test-case-name: tests.unit.test_worker_engine -*-
"""Legacy name of L{kcoral.builtins} (older uploaded code imports C{kcoral.builtin})."""

from kcoral.builtins import *  # noqa: F403
from kcoral.builtins import __all__  # noqa: F401
