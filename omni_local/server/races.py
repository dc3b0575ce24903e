"""Waiting for one thing unless another comes first: a reply's next event unless its client has
gone (completions.py), or unless the server's shutdown grace is over (shutdown.py)."""

from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio

T = TypeVar("T")


async def unless(work: Awaitable[T], stop: Callable[[], Awaitable[object]]) -> T | None:
    """`work`'s result, or None (`work` cancelled) if `stop()` returns first."""
    result, failure = None, None
    async with anyio.create_task_group() as group:
        async def watch() -> None:
            await stop()
            group.cancel_scope.cancel()

        group.start_soon(watch)
        try:
            result = await work
        except Exception as error:  # noqa: BLE001 - raised as it is below, not in a task group's ExceptionGroup
            failure = error
        group.cancel_scope.cancel()
    if failure is not None:
        raise failure
    return result
