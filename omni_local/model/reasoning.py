"""A Thinking checkpoint's reasoning block: `<think>` reasoning `</think>` answer.

Qwen's Thinking template ends its generation prompt with `<think>\\n`, so a reply starts inside the
block and holds only its end, `</think>`. Both markers are ordinary tokens of the vocabulary (they
decode as text), one id each.
"""

from dataclasses import dataclass
from typing import Any

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningMarks:
    start: int  # the id of <think>
    end: int  # the id of </think>

    def split(self, reply_ids: list[int], reasoned: bool) -> tuple[list[int], list[int]]:
        """A reply's reasoning ids and answer ids, the end marker in neither. A reply without the end
        marker is all reasoning if it `reasoned` (it stopped before its answer), else all answer."""
        if self.end in reply_ids:
            cut = reply_ids.index(self.end)
            return reply_ids[:cut], reply_ids[cut + 1:]
        return (list(reply_ids), []) if reasoned else ([], list(reply_ids))


def reasoning_marks(tokenizer: Any) -> ReasoningMarks | None:
    """The markers' ids, if the vocabulary has both as single tokens."""
    start, end = (tokenizer.convert_tokens_to_ids(token) for token in (THINK_START, THINK_END))
    if None in (start, end) or tokenizer.unk_token_id in (start, end):
        return None
    return ReasoningMarks(start, end)


def template_opens_reasoning(processor: Any) -> bool:
    """Whether the chat template's generation prompt opens a reasoning block, as Thinking's does."""
    question = [{"role": "user", "content": [{"type": "text", "text": "?"}]}]
    try:
        rendered = processor.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that cannot render a plain question opens nothing
        return False
    return isinstance(rendered, str) and rendered.rstrip().endswith(THINK_START)
