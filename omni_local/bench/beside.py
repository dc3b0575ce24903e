"""A chat that is decoding while another chat's prompt is prefilled: how long its reader waits.

The engine computes a long prompt in chunks, one per turn, and every chat decoding gets a token each
turn; so the gap between two of its tokens is one chunk and one decode step, not the whole prefill.
This times the gaps as the decoding chat's reader sees them: when each text delta arrives (a token
that ends inside a character sends its text with the next, so a gap there spans two tokens).
"""

import threading
import time
from collections.abc import Callable

from omni_local.api import Finished, OmniLocal, Reply, TextDelta

# The decoding chat's reply: long enough to outlast any prefill timed beside it; cancelled once the
# timed turn has its first token.
BESIDE_TOKENS = 2048
BESIDE_QUESTION = "Tell me a long story about the sea, the ships on it and the people who sail them."
STREAMING_DELTAS = 2  # deltas the decoding chat streams before the timed turn is sent: it is decoding


def beside_a_decoding_chat(app: OmniLocal, system: str, run: int, timed: Callable[[], Reply]) -> tuple[Finished, float]:
    """The final event of `timed()`, sent while another chat of `app` decodes, and that chat's longest
    gap between two deltas, in seconds, from the send to the timed reply's first token (NaN if it did
    not stream through that whole time)."""
    other = app.session(system_prompt=system).send(f"Chat beside {run}: {BESIDE_QUESTION}",
                                                   max_new_tokens=BESIDE_TOKENS)
    arrivals: list[float] = []
    reader = threading.Thread(target=_read_deltas, args=(other, arrivals), daemon=True)
    reader.start()
    while len(arrivals) < STREAMING_DELTAS and reader.is_alive():
        time.sleep(0.001)
    sent = time.perf_counter()
    final = timed().result()
    other.cancel()
    reader.join(timeout=60)
    return final, longest_gap(arrivals, sent, sent + final.timings.ttft_s)


def longest_gap(arrivals: list[float], start: float, end: float) -> float:
    """The longest time between two consecutive `arrivals` that overlaps [start, end]; NaN unless
    arrivals come both before `start` and after `end` (else a gap may lie outside what was seen)."""
    if not arrivals or arrivals[0] > start or arrivals[-1] < end:
        return float("nan")
    return max(later - earlier for earlier, later in zip(arrivals, arrivals[1:]) if later >= start and earlier <= end)


def _read_deltas(reply: Reply, arrivals: list[float]) -> None:
    for event in reply:
        if isinstance(event, TextDelta):
            arrivals.append(time.perf_counter())
