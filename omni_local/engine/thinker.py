"""The Thinker's forward, run by us over KV we own.

transformers' modules do the maths (embedding, encoders, decoder layers, lm_head); this file
decides what runs when: the encoders for the media of the uncached tail (MediaEncoder), a prefill
of that tail after the cached rows, then one decode step per token, each writing its keys and
values into the request's slot of the KVStore.
"""

from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from omni_local.engine.kv_store import KVShape, KVStore
from omni_local.engine.media_encoder import MediaEncoder, deepstack_levels
from omni_local.errors import SettingsError
from omni_local.prompts import Message, Prompt, build_prompt


@dataclass
class PreparedPrompt:
    """What a prefill needs: the embeddings and 3D positions of the prompt's tokens from `start` on
    (those before are in the KV already), tensors on the model's device."""

    start: int
    embeds: torch.Tensor  # [1, L - start, hidden]
    positions: torch.Tensor  # [3, 1, L - start]
    rope_delta: int  # position of token t after the prompt is t + rope_delta
    visual_mask: torch.Tensor | None  # [1, L - start], where deepstack features are added
    deepstack: list[torch.Tensor] | None  # one [visual tokens, hidden] per deepstack layer


class ThinkerRunner:
    def __init__(self, thinker: torch.nn.Module, encoder: MediaEncoder, kv_budget_bytes: int, max_tokens: int) -> None:
        self.thinker = thinker
        self.encoder = encoder
        self.model = thinker.model  # Qwen3OmniMoeThinkerModel: .visual, .audio_tower, .language_model
        self.text = self.model.language_model
        config = self.text.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shape = KVShape(config.num_hidden_layers, config.num_key_value_heads, head_dim, max_tokens)
        self.device = thinker.lm_head.weight.device
        self.dtype = thinker.lm_head.weight.dtype
        slots = kv_budget_bytes // shape.slot_bytes(self.dtype)
        if slots < 1:
            need = shape.slot_bytes(self.dtype)
            raise SettingsError(
                f"setting 'gpu_cache_bytes' ({kv_budget_bytes:,}) is below the {need:,} bytes one conversation of "
                f"'max_context_tokens' ({max_tokens}) needs: raise the first or lower the second"
            )
        self.kv = KVStore(shape, slots, self.dtype, self.device)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """A small prompt with an image and a clip through a prefill and a decode step, in a slot
        nobody reads, so the first request does not pay first-use costs (kernel loading, library
        heuristics: about 2 s for a first image on an H200). Nothing is cached."""
        parts = [Image.new("RGB", (64, 64), (90, 140, 200)), np.zeros(16_000, np.float32), "Hello."]
        prompt = build_prompt([Message("user", parts)], self.encoder.processor)
        slot = self.kv.allocate()
        try:
            prepared = self.prepare(prompt, 0, remember=False)
            token = int(self.prefill(slot, prepared).argmax())
            self.decode(slot, token, prompt.num_tokens, prepared.rope_delta)
        finally:
            self.kv.release(slot)

    @torch.inference_mode()
    def prepare(self, prompt: Prompt, start: int, remember: bool = True) -> PreparedPrompt:
        """Embed the tokens from `start` on; only media from there on are encoded (or taken from the
        encoder cache)."""
        ids = prompt.input_ids.to(self.device)
        # Positions of the whole sequence, then the tail's slice: a tail on a cached prefix gets
        # exactly the positions a cold prefill would give it.
        positions, deltas = self.model.get_rope_index(
            ids,
            image_grid_thw=_to(prompt.image_grid_thw, self.device),
            attention_mask=torch.ones_like(ids),
            audio_seqlens=_to(prompt.audio_feature_lengths, self.device),
        )
        tail = ids[:, start:]
        embeds = self.model.get_input_embeddings()(tail)
        media = [m for m in prompt.media if m.start >= start]
        outputs = self.encoder.encode(media, remember)
        config = self.model.config
        clips = [o["embeds"] for m, o in zip(media, outputs) if not m.is_image]
        if clips:
            embeds = _scatter(embeds, tail == config.audio_token_id, torch.cat(clips))
        images = [o for m, o in zip(media, outputs) if m.is_image]
        visual_mask, deepstack = None, None
        if images:
            visual_mask = tail == config.image_token_id
            embeds = _scatter(embeds, visual_mask, torch.cat([o["embeds"] for o in images]))
            deepstack = [level.to(embeds.dtype) for level in deepstack_levels(images)]
        return PreparedPrompt(start, embeds, positions[:, :, start:], int(deltas.reshape(-1)[0]), visual_mask, deepstack)

    @torch.inference_mode()
    def prefill(self, slot: int, prepared: PreparedPrompt) -> torch.Tensor:
        """Compute the prompt's tail into the slot, after the `start` rows it holds; returns the last
        token's logits [vocab]."""
        p = prepared
        return self._forward(slot, p.start, p.embeds, p.positions, p.visual_mask, p.deepstack)

    @torch.inference_mode()
    def decode(self, slot: int, token: int, index: int, rope_delta: int) -> torch.Tensor:
        """Compute token `token` at sequence index `index` of the slot; returns its logits [vocab]."""
        ids = torch.tensor([[token]], device=self.device)
        embeds = self.model.get_input_embeddings()(ids)
        positions = torch.full((3, 1, 1), index + rope_delta, device=self.device, dtype=torch.long)
        return self._forward(slot, index, embeds, positions, None, None)

    def _forward(
        self,
        slot: int,
        start: int,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        visual_mask: torch.Tensor | None,
        deepstack: list[torch.Tensor] | None,
    ) -> torch.Tensor:
        cache = self.kv.view(slot, start)
        hidden = embeds
        rotary = self.text.rotary_emb(hidden, positions)
        mask = _causal_mask(self.text.config._attn_implementation, start, hidden.shape[1], hidden)
        for index, layer in enumerate(self.text.layers):
            hidden = layer(hidden, attention_mask=mask, cache=cache, position_embeddings=rotary)
            # DeepStack: the vision encoder's intermediate features join the first decoder layers.
            if deepstack is not None and index < len(deepstack):
                hidden = self.text._deepstack_process(hidden, visual_mask, deepstack[index])
        last = self.text.norm(hidden[:, -1:])
        return self.thinker.lm_head(last)[0, -1].float()


def _causal_mask(implementation: str, start: int, length: int, like: torch.Tensor) -> torch.Tensor | None:
    """The mask for `length` new tokens after `start` cached ones, in the form each kernel wants.

    SDPA and flash attention apply the causal rule themselves where it is right (an empty prefix,
    or one new token; flash aligns it bottom-right, so a tail on a prefix too). Passing None there,
    as transformers does, keeps our logits bit-identical to its own.
    """
    if length == 1 or implementation == "flash_attention_2" or (start == 0 and implementation == "sdpa"):
        return None
    rows = torch.arange(length, device=like.device)[:, None] + start
    cols = torch.arange(start + length, device=like.device)[None, :]
    allowed = (cols <= rows)[None, None]
    if implementation == "sdpa":
        return allowed
    # eager attention adds the mask to the scores
    blocked = torch.finfo(like.dtype).min
    return torch.zeros(allowed.shape, dtype=like.dtype, device=like.device).masked_fill(~allowed, blocked)


def _scatter(embeds: torch.Tensor, placeholders: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Put encoder rows, in order, where the placeholder tokens are ([1, n] mask)."""
    return embeds.masked_scatter(placeholders.unsqueeze(-1), rows.to(embeds.dtype))


def _to(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(device)
