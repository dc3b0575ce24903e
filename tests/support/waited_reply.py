"""A backend's reply that waited in line twice before its text: what a request beyond the engine's
seats streams, for the readers of replies (the API's stream, the voice conversation) without a model."""

from omni_local.protocol.events import ContextUse, Finished, TextDelta, TokenCounts, Timings, Waiting

TEXT = TextDelta("Hello")
END = Finished(text="Hello", token_ids=None, stop_reason="end_of_turn",
               tokens=TokenCounts(None, None, None, None, None), timings=Timings(None, None, None), seed=None,
               context=ContextUse(None, None))


class WaitedStream:
    def events(self):
        return iter([Waiting(2), Waiting(1), TEXT, END])

    def cancel(self) -> None:
        raise AssertionError("a reply read to its end is not cancelled")
