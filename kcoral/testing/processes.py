"""
A Python thread that starts a child process, for the tests of the walks
that find a process's children (L{kcoral.proctree}, the worker's reuse
checks): which thread started a child decides where the kernel lists it.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from types import TracebackType

#: What the child runs: it sleeps until it is killed.
SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


class ThreadWithChild:
    """
    A thread that, once told (L{start_child}), starts one L{SLEEPER} child
    and waits until the block ends, when the child is killed and reaped.
    """

    def __init__(self) -> None:
        self.child: subprocess.Popen[bytes] | None = None
        self._go = threading.Event()
        self._started = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ThreadWithChild:
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._go.set()
        self._thread.join()
        if self.child is not None:
            self.child.kill()
            self.child.wait()

    @property
    def native_id(self) -> int:
        """The thread's id as the kernel knows it."""
        assert self._thread.native_id is not None
        return self._thread.native_id

    def start_child(self, timeout: float = 10.0) -> int:
        """Have the thread start its child; its pid."""
        self._go.set()
        if not self._started.wait(timeout):
            raise TimeoutError("the thread did not start its child")
        assert self.child is not None
        return self.child.pid

    def _run(self) -> None:
        self._go.wait()
        if self._stop.is_set():
            return
        self.child = subprocess.Popen(SLEEPER)
        self._started.set()
        self._stop.wait()
