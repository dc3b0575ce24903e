"""The Thinker's forward, run by us over KV we own.

transformers' modules do the maths (embedding, encoders, decoder layers, lm_head); this file
decides what runs when: the encoders for the media of the uncached tail (MediaEncoder), a prefill
of that tail after the cached rows, then one decode step per token, each writing its keys and
values into the request's slot of the KVStore. On a GPU the decode step replays CUDA graphs
captured at start-up (DecodeGraphs); the prefill, whose length varies, runs eagerly.
"""

from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from omni_local.engine.decode_graphs import DecodeGraphs, graphable
from omni_local.engine.decoder_stack import mrope_positions, run_layers
from omni_local.engine.kv_store import GraphedSlotWriter, KVShape, KVStore, SlotWriter
from omni_local.engine.media_encoder import MediaEncoder, deepstack_levels
from omni_local.errors import SettingsError
from omni_local.engine.talker import TalkerRows
from omni_local.prompts import Message, Prompt, build_prompt


@dataclass(frozen=True)
class MediaCounts:
    """Where a prompt's images, clips and videos came from."""

    in_kv: int = 0  # inside the prefix the KV cache supplied: nothing to encode
    from_cache: int = 0  # encoder outputs from the encoder cache
    encoded: int = 0  # run through the encoders


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
    ids: torch.Tensor  # [1, L - start] the tail's token ids
    media: "MediaCounts"


class ThinkerRunner:
    def __init__(
        self,
        thinker: torch.nn.Module,
        encoder: MediaEncoder,
        kv_budget_bytes: int,
        max_tokens: int,
        talker_rows: TalkerRows | None = None,
        cuda_graphs: bool = False,
    ) -> None:
        self.thinker = thinker
        self.talker_rows = talker_rows
        self.encoder = encoder
        self.model = thinker.model  # Qwen3OmniMoeThinkerModel: .visual, .audio_tower, .language_model
        self.text = self.model.language_model
        config = self.text.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        talker_dim = talker_rows.width if talker_rows else 0
        shape = KVShape(config.num_hidden_layers, config.num_key_value_heads, head_dim, max_tokens, talker_dim)
        self.device = thinker.lm_head.weight.device
        self.dtype = thinker.lm_head.weight.dtype
        slots = kv_budget_bytes // shape.slot_bytes(self.dtype)
        if slots < 1:
            need = shape.slot_bytes(self.dtype)
            raise SettingsError(
                f"setting 'gpu_cache_bytes' ({kv_budget_bytes:,}) is below the {need:,} bytes one conversation of "
                f"'max_context_tokens' ({max_tokens}) needs: raise the first or lower the second"
            )
        self._capture_graphs = cuda_graphs and graphable(config, self.device)
        self.kv = KVStore(shape, slots, self.dtype, self.device, zeroed=self._capture_graphs)
        self.graphs: DecodeGraphs | None = None  # set once captured, by warm_up

    @torch.inference_mode()
    def warm_up(self) -> None:
        """A small prompt with an image and a clip through a prefill and a decode step, in a slot
        nobody reads, so the first request does not pay first-use costs (kernel loading, library
        heuristics: about 2 s for a first image on an H200), and captures the decode graphs. Nothing
        is cached."""
        parts = [Image.new("RGB", (64, 64), (90, 140, 200)), np.zeros(16_000, np.float32), "Hello."]
        prompt = build_prompt([Message("user", parts)], self.encoder.processor)
        slot = self.kv.allocate()
        try:
            prepared = self.prepare(prompt, 0, remember=False)
            token = int(self.prefill(slot, prepared).argmax())
            self.decode(slot, token, prompt.num_tokens, prepared.rope_delta)
            if self._capture_graphs:
                ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
                self.graphs = DecodeGraphs(self._decode_step, self.kv, ids, slot, self.text.config)
        finally:
            self.kv.release(slot)

    @torch.inference_mode()
    def prepare(self, prompt: Prompt, start: int, remember: bool = True) -> PreparedPrompt:
        """Embed the tokens from `start` on; only media from there on are encoded (or taken from the
        encoder cache)."""
        # Positions of the whole sequence, then the tail's slice: a tail on a cached prefix gets
        # exactly the positions a cold prefill would give it.
        positions, rope_delta = mrope_positions(self.model, prompt, self.device)
        tail = prompt.input_ids[:, start:].to(self.device)
        embeds = self.model.get_input_embeddings()(tail)
        media = [m for m in prompt.media if m.start >= start]
        outputs, encoded = self.encoder.encode(media, remember)
        counts = MediaCounts(in_kv=len(prompt.media) - len(media), from_cache=len(media) - encoded, encoded=encoded)
        config = self.model.config
        # Each kind's rows go to its placeholders in prompt order: a video's sound track among the
        # clips, its frames among the images (one visual mask, as transformers' DeepStack takes it).
        sounds = [o["audio"] if m.is_video else o["embeds"] for m, o in zip(media, outputs) if m.has_audio]
        if sounds:
            embeds = _scatter(embeds, tail == config.audio_token_id, torch.cat(sounds))
        visuals = [o for m, o in zip(media, outputs) if m.is_image or m.is_video]
        visual_mask, deepstack = None, None
        if visuals:
            visual_ids = torch.tensor([config.image_token_id, config.video_token_id], device=tail.device)
            visual_mask = torch.isin(tail, visual_ids)
            embeds = _scatter(embeds, visual_mask, torch.cat([o["embeds"] for o in visuals]))
            deepstack = [level.to(embeds.dtype) for level in deepstack_levels(visuals)]
        return PreparedPrompt(start, embeds, positions[:, :, start:], rope_delta, visual_mask, deepstack, tail, counts)

    @torch.inference_mode()
    def prefill(self, slot: int, prepared: PreparedPrompt) -> torch.Tensor:
        """Compute the prompt's tail into the slot, after the `start` rows it holds; returns the last
        token's logits [vocab]. With a Talker, each new token's Talker row is written too."""
        p, rows = prepared, self.talker_rows
        last, kept = run_layers(self.text, self.kv.view(slot, p.start), p.embeds, p.positions, p.visual_mask,
                                p.deepstack, keep_layer=rows.accept_layer if rows else None)
        if rows is not None:
            self.kv.talker_rows[slot, p.start : p.start + p.embeds.shape[1]] = rows.project(p.ids, p.embeds, kept)[0]
        return self._logits(last)

    @torch.inference_mode()
    def decode(self, slot: int, token: int, index: int, rope_delta: int) -> torch.Tensor:
        """Compute token `token` at sequence index `index` of the slot; returns its logits [vocab]."""
        ids = torch.tensor([[token]], device=self.device)
        if self.graphs is not None:
            return self.graphs.replay(slot, ids, index, index + rope_delta)
        positions = torch.full((3, 1, 1), index + rope_delta, device=self.device, dtype=torch.long)
        return self._decode_step(self.kv.view(slot, index), ids, positions)

    def _decode_step(self, cache: SlotWriter | GraphedSlotWriter, ids: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
        """Logits [vocab] of one token (ids [1, 1], positions [3, 1, 1]): what the graphs capture."""
        last, _ = run_layers(self.text, cache, self.model.get_input_embeddings()(ids), positions)
        return self._logits(last)

    def _logits(self, last: torch.Tensor) -> torch.Tensor:
        return self.thinker.lm_head(last)[0, -1].float()


def _scatter(embeds: torch.Tensor, placeholders: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Put encoder rows, in order, where the placeholder tokens are ([1, n] mask)."""
    return embeds.masked_scatter(placeholders.unsqueeze(-1), rows.to(embeds.dtype))
