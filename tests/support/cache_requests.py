"""Prompts made by hand and requests run through a PrefixCache as the engine runs them, for the
cache's unit tests (no model)."""

import numpy as np
import torch

from omni_local.access import LOCAL_USER
from omni_local.engine.memory.prefix_cache import PrefixCache
from omni_local.engine.prompt.builder import MediaItem, Prompt, token_keys


def prompt(ids: list[int], media: list[tuple[int, int, bytes]] = ()) -> Prompt:
    items = [MediaItem(None, digest, start, length, grid=(1, 2, 2)) for start, length, digest in media]
    array = np.array(ids, dtype=np.int64)
    return Prompt(torch.tensor([ids]), items, token_keys(array, list(media)))


def run(cache: PrefixCache, session: str, p: Prompt, reply: list[int] = (), rows: int | None = None,
        principal: str = LOCAL_USER) -> int:
    """Claim, 'compute' and release like the engine, for `principal`; returns the tokens reused."""
    match = cache.match(p, principal=principal)
    claim = cache.claim(session, p, match, rows or p.num_tokens + len(reply), principal=principal)
    cache.publish(claim, p, list(reply), p.num_tokens + max(len(reply) - 1, 0))
    cache.release(claim)
    return claim.start
