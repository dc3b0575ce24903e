"""The public Python API.

    from omni_local.api import OmniLocal, TextDelta

    with OmniLocal() as app:                       # settings.toml, else the demo model
        chat = app.session(system_prompt="You are concise.")
        for event in chat.send("What is in this picture?", images=["cat.jpg"]):
            if isinstance(event, TextDelta):
                print(event.text, end="", flush=True)
        print(chat.history[-1].text)               # the reply, kept for the next turn

A reply is a stream of `TextDelta` events (and `AudioChunk`s, for `send(..., speak=True)`;
`ReasoningDelta`s before the answer, from a Thinking checkpoint) and one final `Finished` (text,
reasoning, token counts, timings, speech figures, tool calls). `send(..., tools=[Tool(...)])` offers
functions to call: each call comes as a `ToolCall`, and its result goes back in the next
`send(tool_results={call.id: "..."})`. A reply the engine cannot start at once (every seat taken)
first streams `Waiting` events, its place in line (`Reply.waiting`). Bad input raises
`OmniLocalError` with a message meant for the user; the session and the backend keep working.
The same API runs on the engine in this process or on a remote server (`backend = "openai"`).
"""

from omni_local.api.app import OmniLocal
from omni_local.api.session import Reply, Session
from omni_local.errors import OmniLocalError
from omni_local.protocol.events import AudioChunk, Finished, ReasoningDelta, TextDelta, Waiting
from omni_local.protocol.functions import Tool, ToolCall
from omni_local.protocol.tools import FunctionChoice

__all__ = ["OmniLocal", "Session", "Reply", "TextDelta", "ReasoningDelta", "AudioChunk", "Finished", "OmniLocalError",
           "Tool", "ToolCall", "FunctionChoice", "Waiting"]
