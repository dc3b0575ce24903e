"""The engine serves before its prefill graphs are captured, and captures them while it is idle.

Where the demo runs on the CPU there are no graphs: ThinkerRunner's prefill graphs are stood in for
by a count and a capture that records when the engine called it. The captures themselves, and a
prompt sent before them, are tested on a GPU (test_cuda_graphs.py)."""

import logging
import threading

import pytest

from waiting import until
from omni_local.api import OmniLocal
from omni_local.engine.forward.thinker import ThinkerRunner


class StandInGraphs:
    """`left` prefill graphs to capture; each capture notes whether the engine had a request waiting
    or running, and how many of the test's requests had ended by then."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, left: int, fail: bool = False) -> None:
        self.left, self.fail = left, fail
        self.engine = None  # the test's, once started
        self.requests = []  # the test's, in the engine
        self.captured_after: list[int] = []  # at each capture, how many of them had ended
        self.busy_at_capture: list[bool] = []
        self.first = threading.Event()  # the first capture waits for it
        monkeypatch.setattr(ThinkerRunner, "prefill_graphs_left", property(lambda runner: self.left))
        monkeypatch.setattr(ThinkerRunner, "capture_a_prefill_graph", lambda runner: self.capture())
        monkeypatch.setattr(ThinkerRunner, "stop_capturing", lambda runner: setattr(self, "left", 0))

    def capture(self) -> None:
        if not self.captured_after:
            self.first.wait(timeout=10)
        engine = self.engine
        busy = engine is not None and engine.busy
        self.busy_at_capture.append(busy)
        self.captured_after.append(sum(request.ended for request in self.requests))
        if self.fail:
            raise RuntimeError("out of memory")
        self.left -= 1


def test_an_app_that_does_not_wait_answers_before_its_prefill_graphs_and_captures_them_only_while_idle(
    demo_settings, demo_checkpoint, monkeypatch
):
    graphs = StandInGraphs(monkeypatch, left=4)
    with OmniLocal(demo_settings, wait_for_graphs=False) as app:
        graphs.engine = engine = app.backend.engine
        assert not engine.warm.is_set(), "it must serve before the graphs are captured"
        reply = app.session().send("Hello there.", max_new_tokens=6)
        graphs.requests.append(reply._stream.request)
        # The first capture waits until the question is in the engine's line: it is served next.
        until(lambda: engine.queued or engine.busy, "the question must reach the engine's line")
        graphs.first.set()
        final = reply.result()
        assert final.tokens.generated > 0
        assert engine.warm.wait(timeout=30), "the graphs left must be captured once it is idle"
    assert graphs.left == 0 and len(graphs.captured_after) == 4
    assert not any(graphs.busy_at_capture), "a capture must never run while a request waits or runs"
    assert graphs.captured_after[0] == 0 and graphs.captured_after[-1] == 1


def test_an_app_that_waits_for_its_graphs_starts_with_every_one_captured(demo_settings, demo_checkpoint, monkeypatch):
    graphs = StandInGraphs(monkeypatch, left=3)
    graphs.first.set()
    with OmniLocal(demo_settings) as app:
        assert app.backend.engine.warm.is_set() and graphs.left == 0


def test_a_capture_that_fails_leaves_the_engine_warm_and_answering_eagerly(
    demo_settings, demo_checkpoint, monkeypatch, caplog
):
    graphs = StandInGraphs(monkeypatch, left=5, fail=True)
    with caplog.at_level(logging.WARNING, logger="omni_local.engine.engine"):
        with OmniLocal(demo_settings, wait_for_graphs=False) as app:
            graphs.engine = app.backend.engine
            graphs.first.set()
            assert app.backend.engine.warm.wait(timeout=30)
            assert app.session().send("Hello there.", max_new_tokens=4).result().tokens.generated > 0
    assert len(graphs.captured_after) == 1, "after a failed capture none is tried again"
    assert "prefill graph could not be captured (out of memory): prefills without one run eagerly" in caplog.text
