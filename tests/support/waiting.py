"""Waiting in a test for something another thread makes true, never for ever: a state the test polls
for can pass between two polls on a busy machine, and a test that spins on it then hangs its whole
run instead of failing."""

import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def came_true(condition: Callable[[], object], seconds: float) -> bool:
    """Whether `condition()` came true within `seconds`."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def until(condition: Callable[[], object], what: str, seconds: float = 30.0) -> None:
    """Wait for `condition()`; fail saying `what` if it does not come true within `seconds`."""
    assert came_true(condition, seconds), what


def within(work: Callable[[], T], what: str, seconds: float = 30.0) -> T:
    """What `work()` returns, or raises, run on another thread; fails saying `what` where it takes
    longer than `seconds` (the thread, a daemon, is left behind)."""
    outcome: list[tuple[bool, object]] = []

    def run() -> None:
        try:
            outcome.append((True, work()))
        except BaseException as error:  # noqa: BLE001 - raised again on the test's thread
            outcome.append((False, error))

    threading.Thread(target=run, daemon=True).start()
    until(lambda: outcome, what, seconds)
    returned, value = outcome[0]
    if not returned:
        raise value
    return value
