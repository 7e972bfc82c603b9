"""
L{kcoral.gateway.natsbridge.start_task}: a bridge call's coroutine begins
in the call that makes its task where Python can (3.12's eager tasks), so
a publish is in nats-py's buffer before the caller goes on.
"""

from __future__ import annotations

import asyncio

from twisted.trial.unittest import SynchronousTestCase

from kcoral.gateway.natsbridge import EAGER_TASKS, start_task


class StartTaskTests(SynchronousTestCase):
    def _complete(self, main: object) -> object:
        loop = asyncio.new_event_loop()
        try:
            return loop.run_until_complete(main)  # type: ignore[arg-type]
        finally:
            loop.close()

    def test_begins_at_once_where_python_can(self) -> None:
        """
        Before C{start_task} returns, the coroutine has run up to its first
        wait on Python 3.12 and later; before, it waits for the loop's next
        turn, as C{ensure_future} has it.
        """
        steps: list[str] = []

        async def work(gate: asyncio.Future[str]) -> str:
            steps.append("begun")
            return await gate

        async def main() -> tuple[list[str], str]:
            gate: asyncio.Future[str] = asyncio.get_running_loop().create_future()
            task = start_task(work(gate))
            seen = list(steps)
            gate.set_result("done")
            return seen, await task

        seen, result = self._complete(main())  # type: ignore[misc]
        self.assertEqual(seen, ["begun"] if EAGER_TASKS else [])
        self.assertEqual(result, "done")

    def test_finished_at_once(self) -> None:
        """A coroutine with nothing to wait for still gives its result (or error) through the task."""

        async def fails() -> None:
            raise ValueError("no")

        async def main() -> asyncio.Future[None]:
            task = start_task(fails())
            with self.assertRaises(ValueError):
                await task
            return task

        task = self._complete(main())
        self.assertTrue(task.done())  # type: ignore[attr-defined]
