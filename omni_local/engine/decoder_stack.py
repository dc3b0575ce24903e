"""One forward of a transformers decoder stack (the Thinker's or the Talker's) over a KVStore slot.

The layers, rotary embedding and norm are transformers' own modules; we pass the cache (a
SlotWriter, or in a CUDA graph a GraphedSlotWriter), its mask and the 3D positions ourselves,
which is all that differs from their forward.
"""

import torch

from omni_local.engine.kv_store import GraphedSlotWriter, SlotWriter
from omni_local.prompts import Prompt


def run_layers(
    stack: torch.nn.Module,
    cache: SlotWriter | GraphedSlotWriter,
    embeds: torch.Tensor,
    positions: torch.Tensor,
    visual_mask: torch.Tensor | None = None,
    deepstack: list[torch.Tensor] | None = None,
    keep_layer: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run `embeds` [B, n, hidden] at `positions` [3, B, n] after the rows each slot already holds
    (B = 1 except in a graphed batch).

    Returns the normed hidden state [B, 1, hidden] of each sequence's last token (the one
    `cache.last_states` picks) and, if `keep_layer` is given, the hidden states [B, n, hidden]
    transformers reports as `hidden_states[keep_layer]`: the input embeddings for 0, the output of
    layer `keep_layer - 1` (before DeepStack adds to it) up to the last layer, whose output is
    reported normed.
    """
    hidden = embeds
    kept = hidden if keep_layer == 0 else None
    rotary = stack.rotary_emb(hidden, positions)
    mask = cache.attention_mask(stack.config._attn_implementation, hidden.shape[1], hidden)
    last = len(stack.layers)
    for index, layer in enumerate(stack.layers):
        hidden = layer(hidden, attention_mask=mask, cache=cache, position_embeddings=rotary)
        if keep_layer == index + 1 and keep_layer < last:
            kept = hidden
        # DeepStack: the vision encoder's intermediate features join the first decoder layers, at the
        # visual tokens (`visual_mask`), or given dense ([B, n, hidden], zero elsewhere: adding zero
        # changes nothing) where a graph cannot pick rows by a mask.
        if deepstack is not None and index < len(deepstack):
            level = deepstack[index]
            hidden = stack._deepstack_process(hidden, visual_mask, level) if visual_mask is not None else hidden + level
    if keep_layer == last:
        kept = stack.norm(hidden)
        return cache.last_states(kept), kept
    return stack.norm(cache.last_states(hidden)), kept


def mrope_positions(owner: torch.nn.Module, prompt: Prompt, device: torch.device) -> tuple[torch.Tensor, int]:
    """3D positions [3, 1, L] of the prompt's tokens by `owner.get_rope_index` (the Thinker's or the
    Talker's), and the delta that places later tokens: token t after the prompt is at t + delta."""
    ids = prompt.input_ids.to(device)
    images, videos, audio = prompt.image_grid_thw, prompt.video_grid_thw, prompt.audio_feature_lengths
    positions, deltas = owner.get_rope_index(
        ids,
        image_grid_thw=images.to(device) if images is not None else None,
        video_grid_thw=videos.to(device) if videos is not None else None,
        attention_mask=torch.ones_like(ids),
        use_audio_in_video=prompt.use_audio_in_video,
        audio_seqlens=audio.to(device) if audio is not None else None,
        second_per_grids=prompt.video_second_per_grid,
    )
    return positions, int(deltas.reshape(-1)[0])
