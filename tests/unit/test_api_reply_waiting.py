"""The API's reply stream leaves out a request's place in line: OpenAI's stream has no field for it."""

import anyio

from omni_local.server.reply import ApiReply
from waited_reply import END, TEXT, WaitedStream


def test_a_reply_that_waited_in_line_reaches_the_api_as_its_text_and_its_end_alone():
    async def sent() -> list:
        reply = ApiReply(WaitedStream(), stops=[], threads=anyio.CapacityLimiter(1))
        return [event async for event in reply.events()]

    assert anyio.run(sent) == [TEXT, END]
