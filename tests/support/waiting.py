"""Waiting in a test for something another thread makes true, never for ever: a state the test polls
for can pass between two polls on a busy machine, and a test that spins on it then hangs its whole
run instead of failing."""

import time
from collections.abc import Callable


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
