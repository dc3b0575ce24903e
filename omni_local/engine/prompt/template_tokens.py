"""A rendered chat template's ids, in which only the template places control tokens.

A tokenizer matches its added tokens (`<|im_start|>`, `<|image_pad|>`, `<think>`, ...) wherever they
stand in the text it is given, so a person who typed `<|im_start|>system` would open a real system
turn. Here the template's own text and the conversation's text are told apart: control tokens are
matched in the template's text only, and each stretch between two of them, the conversation's text
included, is tokenized with no added token recognized at all. That is how the tokenizer itself
tokenizes the text between its added tokens, so a prompt whose text holds none gets the very ids it
always had: the same stretches, the same merges across the seams between template and text.
"""

import functools
import json
import re
from collections.abc import Callable
from typing import Any

from tokenizers import Tokenizer

# About two a message (its role and text, then the newline after its end): a few long chats' worth.
STRETCHES_KEPT = 256


class TemplateIds:
    """A prompt's ids, built from the template's text, the conversation's text and ready-made ids in
    the order they stand."""

    def __init__(self, tokenizer: Any) -> None:
        self._encode, self._controls, self._control_ids = _vocabulary(tokenizer)
        self._ids: list[int] = []
        self._stretch = ""  # text since the last control token or ready-made id, not yet tokenized

    def template(self, text: str) -> None:
        """The template's own text: its control tokens count."""
        for i, piece in enumerate(self._controls.split(text)):
            if i % 2:
                self._flush()
                self._ids.append(self._control_ids[piece])
            else:
                self._stretch += piece

    def text(self, text: str) -> None:
        """A person's text (or a reply kept as text): plain text, whatever it holds."""
        self._stretch += text

    def exact(self, ids: list[int]) -> None:
        """Ids taken as they are (an earlier reply's, as the model made them)."""
        self._flush()
        self._ids += ids

    def finish(self) -> list[int]:
        self._flush()
        return self._ids

    def _flush(self) -> None:
        if self._stretch:
            self._ids += self._encode(self._stretch)
            self._stretch = ""


@functools.lru_cache(maxsize=4)
def _vocabulary(tokenizer: Any) -> tuple[Callable[[str], tuple[int, ...]], re.Pattern[str], dict[str, int]]:
    """The ids of a stretch by the tokenizer with no added tokens (its normalizer, pre-tokenizer and
    merges alone); a pattern that matches any added token, longest first as the tokenizer matches
    them; their ids."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    spec["added_tokens"] = []
    added = tokenizer.get_added_vocab()
    alternatives = "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)) or "(?!)"
    pattern = re.compile(f"({alternatives})")
    return _remembering(Tokenizer.from_str(json.dumps(spec))), pattern, added


def _remembering(plain: Tokenizer) -> Callable[[str], tuple[int, ...]]:
    """`plain`'s encoding of a stretch, remembered: each turn's prompt holds the whole conversation
    again, and its earlier stretches (a 2,000-token system prompt: about 1 ms) are the same text."""

    @functools.lru_cache(maxsize=STRETCHES_KEPT)
    def encode(stretch: str) -> tuple[int, ...]:
        return tuple(plain.encode(stretch, add_special_tokens=False).ids)

    return encode
