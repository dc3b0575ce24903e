"""A voice turn whose reply waits for a seat shows its text and its end, never its place as an error."""

import numpy as np

from omni_local.api import Reply
from omni_local.voice import VoiceConversation
from waited_reply import END, TEXT, WaitedStream


def ask(samples: np.ndarray) -> Reply:
    return Reply(WaitedStream(), on_done=lambda final: None)


def test_a_voice_reply_that_waited_in_line_shows_only_its_text_and_its_end():
    shown: list = []
    # A detector is not needed: the utterance is given whole, as push-to-talk gives it.
    talk = VoiceConversation(ask, play=lambda chunk: None, stop_playing=lambda: None, detector=object(),
                             show=shown.append)
    talk.answer(np.zeros(16_000, np.float32))
    talk.wait()
    assert shown == [TEXT, END]
