"""The Thinker's prefill graphs captured after the engine is ready: one at a time, by the worker,
while nobody waits (a request that comes waits for one capture at most and is computed eagerly
meanwhile); `warm` is set once none is left. The time and GPU memory they took are logged then, a
request served meanwhile counted too."""

import logging
import threading
import time
from collections.abc import Callable

from omni_local.engine.forward.thinker import ThinkerRunner
from omni_local.start_up_steps import gpu_memory, log_start_up_step

log = logging.getLogger(__name__)


class PrefillGraphsWarmUp:
    def __init__(self, runner: ThinkerRunner, when_warm: Callable[[], None]) -> None:
        """`when_warm` runs once every graph is captured, on the thread that captured the last."""
        self.runner, self._when_warm = runner, when_warm
        self.warm = threading.Event()
        self._since, self._memory_before = time.perf_counter(), gpu_memory()
        if not runner.prefill_graphs_left:
            self._became_warm()

    def capture_one(self) -> None:
        """Capture the next graph; if one fails, prefills without a graph run eagerly from then on."""
        try:
            self.runner.capture_a_prefill_graph()
        except Exception as error:  # noqa: BLE001 - serving goes on without the graphs left
            log.warning("a prefill graph could not be captured (%s): prefills without one run eagerly", error)
            self.runner.stop_capturing()
        if not self.runner.prefill_graphs_left:
            log_start_up_step("the Thinker's prefill graphs, after ready (while idle)",
                              time.perf_counter() - self._since, self._memory_before)
            self._became_warm()

    def _became_warm(self) -> None:
        try:
            self._when_warm()
        except Exception as error:  # noqa: BLE001 - what waits on `warm`, and serving, go on regardless
            log.warning("after the graphs were captured: %s", error)
        self.warm.set()
