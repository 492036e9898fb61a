"""Concurrent loops of one coroutine, for the rollouts that run beside training.

    >>> import asyncio
    >>> async def demo():
    ...     done = []
    ...     async def work():
    ...         done.append(len(done))
    ...         if len(done) == 3:
    ...             raise LookupError  # ends this loop
    ...         await asyncio.sleep(0)
    ...     workers = Workers(1, work, ends_on=LookupError)
    ...     workers.start()
    ...     while workers.running():
    ...         await workers.wait_for_progress()
    ...     return done
    >>> asyncio.run(demo())
    [0, 1, 2]
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


class Workers:
    """``n`` asyncio tasks, each calling ``work()`` again and again until :meth:`stop`. A task ends
    when ``work`` raises ``ends_on``. :meth:`wait_for_progress` returns once a ``work()`` call has
    returned, or a task has ended, since it was called."""

    def __init__(self, n: int, work: Callable[[], Awaitable[None]], ends_on: type[BaseException]) -> None:
        self.n = n
        self.work = work
        self.ends_on = ends_on
        self.stopping = False
        self.progress = asyncio.Event()
        self.tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._loop()) for _ in range(self.n)]

    async def _loop(self) -> None:
        while not self.stopping:
            try:
                await self.work()
            except self.ends_on:
                self.progress.set()
                return
            self.progress.set()

    def running(self) -> bool:
        return not all(t.done() for t in self.tasks)

    async def wait_for_progress(self) -> None:
        self.progress.clear()
        await self.progress.wait()

    async def stop(self, timeout_s: float) -> None:
        """No new ``work()`` calls; wait up to ``timeout_s`` for those in flight to finish."""
        self.stopping = True
        pending = [t for t in self.tasks if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=timeout_s)

    async def cancel(self) -> None:
        """Cancel the tasks still running and wait until they have ended."""
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
