"""The KV's bytes as the GPU memory plan (memory_plan.py) counts them: the Thinker's blocks, and with
speech the Talker's KV beside them.

The Talker's KV holds as many of its longest sequences as the Thinker's blocks hold chats of
`max_context_tokens` (speech.py's `talker_sequences`), so its bytes follow the Thinker's KV, not the
engine: at full size a Talker sequence (8,192 tokens of context, the assistant rows and 120 s of
frames, 20 KiB a row) takes 190 MiB beside a Thinker chat's 784 MiB (98 and 412 MiB with fp8 KV).
The plan counts the two together.
"""

from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from omni_local.engine.forward.speech import talker_kv_bytes
from omni_local.engine.forward.thinker import kv_shape
from omni_local.engine.memory.kv_store import KVShape
from omni_local.settings import EngineConfig


@dataclass(frozen=True)
class KVSizes:
    thinker: KVShape
    dtype: torch.dtype
    talker: Callable[[int], int]  # the Talker's KV bytes beside Thinker KV of so many tokens

    @property
    def block_bytes(self) -> int:
        return self.thinker.block_bytes(self.dtype)

    @property
    def least_blocks(self) -> int:
        """The Thinker's blocks of one conversation of `max_context_tokens`, and the pad block."""
        return self.thinker.table_blocks + 1

    def blocks_for(self, tokens: int) -> int:
        """The Thinker's blocks that hold `tokens`, and the pad block."""
        return self.thinker.blocks_for(tokens) + 1

    def tokens(self, blocks: int) -> int:
        """The tokens `blocks` of the Thinker's hold (less the pad block)."""
        return max(blocks - 1, 0) * self.thinker.block_tokens

    def talker_bytes(self, blocks: int) -> int:
        return self.talker(self.tokens(blocks))

    def bytes(self, blocks: int) -> int:
        """`blocks` of the Thinker's KV, and the Talker's KV beside them."""
        return blocks * self.block_bytes + self.talker_bytes(blocks)

    def most_blocks(self, room: int, cap: int) -> int:
        """The most Thinker blocks, of at most `cap` bytes, that fit `room` bytes with the Talker's KV."""
        return bisect_right(range(cap // self.block_bytes + 1), room, key=self.bytes) - 1


def kv_sizes(model: torch.nn.Module, settings: EngineConfig) -> KVSizes:
    """The KV of `model` (loaded, or its parameters on the meta device) as `settings` size it."""
    dtype = next(model.parameters()).dtype
    talker_dim = model.config.talker_config.text_config.hidden_size if settings.speech else 0
    thinker = kv_shape(model.thinker.model.language_model.config, settings.max_context_tokens,
                       settings.kv_block_tokens, talker_dim, settings.kv_dtype == "fp8")
    talker = partial(talker_kv_bytes, model, settings, dtype=dtype) if settings.speech else _no_talker
    return KVSizes(thinker, dtype, talker)


def _no_talker(thinker_tokens: int) -> int:
    return 0
