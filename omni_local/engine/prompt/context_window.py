"""A chat longer than the prompt limit goes on: the prompt leaves its earliest turns out.

Every caller resends the whole conversation each turn, so what is left out must follow from the
conversation alone and stay put as it grows: a prompt that began differently each turn would find
nothing to reuse in the prefix cache. So turns (a user message and what follows it, up to the next)
are left out in steps of a quarter of the limit: the fewest oldest turns whose tokens reach m
quarters, for the smallest m that makes the rest fit. A turn's tokens never change once it is
followed by another, so as the chat grows the same m leaves out the same turns, and the prompt
begins as the cached one did, until the rest no longer fits; then one step more goes. Each step
frees about a quarter of the limit at once: room for the next several turns. The system prompt and
the turn being asked always stay.
"""

from bisect import bisect_left
from itertools import accumulate
from typing import Any

import numpy as np

from omni_local.engine.prompt.builder import Prompt, build_prompt
from omni_local.errors import RequestError
from omni_local.model.reasoning import ReasoningMarks
from omni_local.protocol.messages import Message

STEPS_PER_LIMIT = 4  # turns are left out a quarter of the prompt limit at a time


def fit_prompt(messages: list[Message], processor: Any, limit: int,
               reasoning: ReasoningMarks | None = None) -> tuple[Prompt, int]:
    """The prompt for `messages` (ending in the user turn being asked) in at most `limit` tokens, and
    how many of the earliest turns it leaves out to get there (their media go with them). `reasoning`:
    as build_prompt takes it."""
    prompt = build_prompt(messages, processor, reasoning)
    if prompt.num_tokens <= limit:
        return prompt, 0
    at = _message_starts(prompt, messages, processor.tokenizer)
    if at is None:
        raise RequestError(f"the prompt is {prompt.num_tokens:,} tokens, over the limit of {limit:,} "
                           "(max_prompt_tokens), and its turns cannot be told apart to leave the earliest out")
    head = 1 if messages[0].role == "system" else 0
    turns = [head, *(i for i in range(head + 1, len(messages)) if messages[i].role == "user")]  # first messages
    earlier = [at[end] - at[start] for start, end in zip(turns, turns[1:])]
    kept = prompt.num_tokens - sum(earlier)  # the system prompt, the turn asked and the generation prompt
    if kept > limit:
        raise RequestError(f"this message and the system prompt alone are {kept:,} tokens, over the limit of "
                           f"{limit:,} (max_prompt_tokens)")
    left_out = turns_to_leave_out(earlier, kept, limit)
    # The rest has the tokens counted for it here: the template renders each message alone, and its
    # control tokens cut the text the tokenizer sees, so a message's tokens do not depend on its neighbours.
    return build_prompt([*messages[:head], *messages[turns[left_out]:]], processor, reasoning), left_out


def turns_to_leave_out(sizes: list[int], kept: int, limit: int) -> int:
    """How many of the earlier turns (their `sizes` in tokens, oldest first) to leave out so that the
    rest and the `kept` tokens (at most `limit`) fit in `limit`: the fewest whose tokens reach a whole
    number of steps of a quarter of `limit`, in as few steps as fit."""
    step = max(1, limit // STEPS_PER_LIMIT)
    before = list(accumulate(sizes, initial=0))  # before[k]: tokens of the first k turns
    total = kept + before[-1]
    steps = left_out = 0
    while total - before[left_out] > limit:
        steps += 1
        left_out = min(bisect_left(before, steps * step), len(sizes))
    return left_out


def _message_starts(prompt: Prompt, messages: list[Message], tokenizer: Any) -> dict[int, int] | None:
    """Where each of the prompt's messages that opens a turn of the template starts, by the message's
    index, and the generation prompt (at `len(messages)`) after them; None if they cannot be told
    apart. The template opens each with `<|im_start|>` after the previous one's `<|im_end|>` and
    newline; a reply holds no `<|im_end|>` (it ends the reply), so in a prompt of plain-text messages
    only the template's openings follow one. Tools' results in a row share one turn; a reply begun
    by the caller (a required tool call, builder.py) is the generation prompt's."""
    ids = prompt.input_ids[0].numpy()
    opening = tokenizer.convert_tokens_to_ids("<|im_start|>")
    closing = np.array(tokenizer("<|im_end|>\n", add_special_tokens=False)["input_ids"])
    starts = [int(i) for i in np.flatnonzero(ids == opening)
              if i == 0 or np.array_equal(ids[max(0, i - len(closing)):i], closing)]
    begun = messages[-1].role == "assistant"
    opens = [i for i, m in enumerate(messages[:len(messages) - begun])
             if not (m.role == "tool" and i and messages[i - 1].role == "tool")]
    opens.append(len(messages))
    return dict(zip(opens, starts)) if len(starts) == len(opens) and starts[0] == 0 else None
