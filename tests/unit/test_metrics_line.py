"""The line under each reply reads as words for people: speed, what the caches supplied, what the
prompt left out, and how the reply ended where that is news; numbers with thousands separators."""

import pytest

from omni_local.metrics_line import metrics_line
from omni_local.protocol.events import ContextUse, Finished, MediaCounts, SpeechReport, Timings, TokenCounts


def finished(**fields) -> Finished:
    """A reply that ended on its own: 415 prompt tokens, 380 of them cached, and 24 reply tokens."""
    typical = dict(text="Hi.", token_ids=[1, 2], stop_reason="end_of_turn", tokens=TokenCounts(415, 35, 380, 0, 24),
                   timings=Timings(0.0004, 0.017, 142.3), seed=1, context=ContextUse(8192, 6144))
    return Finished(**(typical | fields))


def line_of(**fields) -> str:
    return metrics_line(finished(**fields))


def test_a_reply_that_ended_on_its_own_tells_its_speed_and_cache_use_only():
    line = line_of()
    assert line == "TTFT 17 ms · 142 tok/s · 380 of 415 prompt tokens from cache · 24 reply tokens"


def test_large_counts_have_thousands_separators_and_turns_left_out_are_told():
    line = line_of(tokens=TokenCounts(12_345, 1_000, 10_000, 1_345, 1_024),
                    context=ContextUse(16_384, 12_288, 3))
    assert line == ("TTFT 17 ms · 142 tok/s · 11,345 of 12,345 prompt tokens from cache (1,345 from host memory) · "
                    "1,024 reply tokens · 3 earlier turns left out to fit 12,288 tokens")


@pytest.mark.parametrize("reason, words", [("max_new_tokens", "reply length limit reached"),
                                           ("context_full", "context full"), ("cancelled", "stopped")])
def test_a_reply_cut_short_says_why_in_words(reason, words):
    assert line_of(stop_reason=reason).endswith(" · 24 reply tokens · " + words)


def test_one_of_a_thing_is_singular_and_a_long_wait_for_the_engine_is_told():
    line = line_of(tokens=TokenCounts(40, 40, 0, 0, 1), timings=Timings(1.9, 2.04, 0.0),
                    context=ContextUse(8192, 6144, 1))
    assert line == ("TTFT 2.0 s (queued 1.9 s) · 0 of 40 prompt tokens from cache · 1 reply token · "
                    "1 earlier turn left out to fit 6,144 tokens")


def test_a_spoken_reply_and_the_media_of_its_prompt_are_told_in_words():
    speech = SpeechReport(voice="Ethan", frames=30, audio_s=2.4, first_audio_s=0.0884, real_time_factor=0.231,
                          talker_prompt=120, talker_reused=0)
    line = line_of(speech=speech, media=MediaCounts(in_kv=1, from_cache=0, encoded=2))
    assert line == ("TTFT 17 ms · 142 tok/s · 380 of 415 prompt tokens from cache · 24 reply tokens · "
                    "media: 2 encoded, 0 from the encoder cache, 1 in the cached prompt · "
                    "2.4 s of speech (Ethan), first audio 88 ms, real-time factor 0.23")


def test_figures_a_remote_backend_did_not_report_are_unknown_not_zero():
    line = line_of(tokens=TokenCounts(415, None, 380, None, 24), timings=Timings(None, 0.05, None),
                   context=ContextUse(None, None), media=None, seed=None)
    assert line == "TTFT 50 ms · 380 of 415 prompt tokens from cache · 24 reply tokens"
    nothing = line_of(tokens=TokenCounts(None, None, None, None, None), timings=Timings(None, None, None))
    assert nothing == "TTFT unknown · unknown of unknown prompt tokens from cache"
