"""The calls in a reply's text, in the chat template's format: `<tool_call>` a JSON object
`{"name": ..., "arguments": {...}}` `</tool_call>`, as Qwen3-Omni writes them (tools.py).

Read as the text streams: text outside calls passes on as it comes, and a call's text is held from
its `<tool_call>` until `</tool_call>` closes it; it then comes out as a `ToolCall`, or, if it is no
call of an offered tool (JSON that does not parse, no name, a name not offered, arguments that are
not an object), as the text it was. A call still open when the reply ends is text too. Without
`parallel`, the first call is kept and later ones are dropped. Blank text (the line breaks between
calls, and the one after text before a call) is held until more text follows it, so a reply of calls
alone has no content, and text before a call does not end in its line break: the template puts that
back before the call when the reply goes back into a prompt.
"""

import json
from collections.abc import Iterator
from dataclasses import replace

from omni_local.protocol.events import Event, Finished, TextDelta, TokenLogprob
from omni_local.protocol.functions import ToolCall, call_id
from omni_local.protocol.tools import CALL_CLOSE, CALL_OPEN, ToolUse

Piece = TextDelta | ToolCall


class ToolCallReader:
    def __init__(self, use: ToolUse) -> None:
        self.use = use
        self.calls: list[ToolCall] = []
        self.text: list[str] = []  # the text passed on
        self._held = ""  # from a call's opening (or what may be the start of one) on
        self._blank = ""  # blank text waiting for more text
        self._fed = 0  # characters fed so far
        # The log-probabilities not passed on yet, each delta's with where its text ends in what was fed:
        # passed on with the text that takes that end, dropped with a call's (OpenAI's are the content's).
        self._logprobs: list[tuple[int, tuple[TokenLogprob, ...]]] = []

    def feed(self, delta: TextDelta) -> list[Piece]:
        self._held += delta.text
        self._fed += len(delta.text)
        if delta.logprobs:
            self._logprobs.append((self._fed, delta.logprobs))
        pieces: list[Piece] = []
        while self._held:
            if self._held.startswith(CALL_OPEN):
                end = self._held.find(CALL_CLOSE)
                if end < 0:
                    break
                end += len(CALL_CLOSE)
                block, self._held = self._held[:end], self._held[end:]
                pieces += self._block(block)
            else:
                start = self._held.find(CALL_OPEN)
                start = start if start >= 0 else len(self._held) - _opening_at_end(self._held)
                if start == 0:
                    break
                text, self._held = self._held[:start], self._held[start:]
                pieces += self._text(text)
        return pieces

    def finish(self) -> list[Piece]:
        """The rest, once the reply has ended: an unclosed call as text; blank text at the end dropped."""
        held, self._held = self._held, ""
        return self._text(held) if held.strip() else []

    def _block(self, block: str) -> list[Piece]:
        call = self._call(block[len(CALL_OPEN):-len(CALL_CLOSE)])
        if call is None:
            return self._text(block)
        ends, begins = self._taken, self._taken - len(block)
        self._logprobs = [(end, logprobs) for end, logprobs in self._logprobs if not begins < end <= ends]
        if self.calls and not self.use.parallel:
            return []
        self.calls.append(call)
        return [call]

    def _call(self, inside: str) -> ToolCall | None:
        try:
            found = json.loads(inside)
        except json.JSONDecodeError:
            return None
        if not isinstance(found, dict) or not isinstance(found.get("name"), str) or not self.use.known(found["name"]):
            return None
        arguments = found.get("arguments", {})
        if not isinstance(arguments, dict):
            return None
        return ToolCall(call_id(), found["name"], json.dumps(arguments, ensure_ascii=False))

    def _text(self, text: str) -> list[Piece]:
        # Blank text that breaks the line at the end of text is held as it is in a piece of its own:
        # a token may hold both (".\n"), and the content must not depend on where the tokens fall.
        body = text.rstrip()
        if "\n" not in text[len(body):]:
            body = text
        if not body.strip():
            self._blank += text
            return []
        text, self._blank = self._blank + body, text[len(body):]
        self.text.append(text)
        released = [logprobs for end, logprobs in self._logprobs if end <= self._taken]
        self._logprobs = self._logprobs[len(released):]
        return [TextDelta(text, tuple(logprob for logprobs in released for logprob in logprobs))]

    @property
    def _taken(self) -> int:
        """Where the text taken from what is held so far ends, in what was fed."""
        return self._fed - len(self._held)


def _opening_at_end(text: str) -> int:
    """How many characters at the end of `text` may begin a call's opening."""
    return next((n for n in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1) if CALL_OPEN.startswith(text[-n:])), 0)


def read_tool_calls(events: Iterator[Event], use: ToolUse) -> Iterator[Event]:
    """A reply's events with its calls read from its text (begun with `use`'s prefix, which the
    prompt began the reply with). The `Finished` holds the text outside the calls and the calls;
    its token ids, which are not those of that text, are dropped."""
    reader = ToolCallReader(use)
    yield from reader.feed(TextDelta(use.reply_prefix))
    for event in events:
        if isinstance(event, TextDelta):
            yield from reader.feed(event)
        elif isinstance(event, Finished):
            yield from reader.finish()
            changed = reader.calls or use.reply_prefix
            yield replace(event, text="".join(reader.text), tool_calls=tuple(reader.calls),
                          token_ids=None if changed else event.token_ids)
        else:
            yield event
