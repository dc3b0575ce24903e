"""The API's reply stream leaves out a request's place in line: OpenAI's stream has no field for it."""

import anyio

from omni_local.protocol.events import ContextUse, Finished, TextDelta, TokenCounts, Timings, Waiting
from omni_local.server.reply import ApiReply

END = Finished(text="Hello", token_ids=None, stop_reason="end_of_turn",
               tokens=TokenCounts(None, None, None, None, None), timings=Timings(None, None, None), seed=None,
               context=ContextUse(None, None))


class Stream:
    """A backend's reply that waited in line twice before its text."""

    def events(self):
        return iter([Waiting(2), Waiting(1), TextDelta("Hello"), END])

    def cancel(self) -> None:
        raise AssertionError("a reply read to its end is not cancelled")


def test_a_reply_that_waited_in_line_reaches_the_api_as_its_text_and_its_end_alone():
    async def sent() -> list:
        reply = ApiReply(Stream(), stops=[], threads=anyio.CapacityLimiter(1))
        return [event async for event in reply.events()]

    assert anyio.run(sent) == [TextDelta("Hello"), END]
