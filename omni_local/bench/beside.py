"""A chat that is decoding while another chat's prompt is prefilled: how long it waits for a token.

The engine computes a long prompt in chunks, one per turn, and every chat decoding gets a token each
turn; so the gap between two of its tokens is one chunk and one decode step, not the whole prefill.
This times the gaps where the engine accepts each token (the host reads it, then streams it). Not
by the text deltas: random weights choose ids the demo tokenizer has no text for, which send none.
"""

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from omni_local.api import Finished, OmniLocal
from omni_local.engine.engine import Engine

# The decoding chat's reply: long enough to outlast any prefill timed beside it; cancelled once the
# timed turn has its first token.
BESIDE_TOKENS = 2048
BESIDE_QUESTION = "Tell me a long story about the sea, the ships on it and the people who sail them."
STREAMING_TOKENS = 2  # tokens the decoding chat has before the timed turn is sent: it is decoding


def beside_a_decoding_chat(app: OmniLocal, system: str, run: int,
                           timed: Callable[[], Finished]) -> tuple[Finished, float]:
    """The final event `timed()` returns (it sends a request and waits for its end) while another chat
    of `app` decodes, and that chat's longest gap between two tokens, in seconds, from the send to the
    timed reply's first token (NaN if it did not decode through that whole time)."""
    session = app.session(system_prompt=system)
    with accepted_tokens(app.backend.engine, session.id) as arrivals:
        other = session.send(f"Chat beside {run}: {BESIDE_QUESTION}", max_new_tokens=BESIDE_TOKENS)
        reader = threading.Thread(target=other.result, daemon=True)
        reader.start()
        while len(arrivals) < STREAMING_TOKENS and reader.is_alive():
            time.sleep(0.001)
        sent = time.perf_counter()
        final = timed()
        other.cancel()
        reader.join(timeout=60)
    return final, longest_gap(arrivals, sent, sent + final.timings.ttft_s)


@contextmanager
def accepted_tokens(engine: Engine, session: str) -> Iterator[list[float]]:
    """When the engine accepts each token of chat `session` meanwhile, in order."""
    times, accept = [], engine._accept

    def clocked(request, token: int, *found: object) -> None:
        if request.session == session:
            times.append(time.perf_counter())
        accept(request, token, *found)

    engine._accept = clocked
    try:
        yield times
    finally:
        del engine._accept


def longest_gap(arrivals: list[float], start: float, end: float) -> float:
    """The longest time between two consecutive `arrivals` that overlaps [start, end]; NaN unless
    arrivals come both before `start` and after `end` (else a gap may lie outside what was seen)."""
    if not arrivals or arrivals[0] > start or arrivals[-1] < end:
        return float("nan")
    return max(later - earlier for earlier, later in zip(arrivals, arrivals[1:]) if later >= start and earlier <= end)
