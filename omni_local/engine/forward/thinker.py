"""The Thinker's forward, run by us over KV we own.

transformers' modules do the maths (embedding, encoders, decoder layers, lm_head); this file
decides what runs when: the encoders for the media of the uncached tail (MediaEncoder), a prefill
of that tail after the cached rows (whole, or the part of it the engine asks for: a chunk,
prefill_chunks.py), then one decode step per token, each writing its keys and values into the
request's blocks of the KVStore. On a GPU, with graphs, the decode step of every chat decoding at the
time runs as one batch, and a prefill of up to the longest of `prefill_lengths` (a chunk, a question,
an image, a long prompt's forward) replays a CUDA graph too (BatchGraphs), captured at start-up or,
in the engine, while it is idle after it serves; longer prefills, and any whose graph is not yet
captured, run eagerly. Eager prefills of several prompts that wait together are one forward, their
tokens packed in one row (`prefill_together`: per-token work once for all, attention sequence by
sequence). A decode step takes its token ids from the device (the engine's
sampler keeps each seat's last choice there) and its positions through pinned memory, so a graphed
step never makes the host wait: the engine queues the next one before reading this one.
"""

import logging
from functools import partial

import numpy as np
import torch
from PIL import Image

from omni_local.access import LOCAL_USER
from omni_local.engine.forward.cuda_graphs import BatchGraphs, graphable, size_buckets
from omni_local.engine.forward.decoder_stack import LayerRegions, mrope_positions, run_layers
from omni_local.engine.forward.fused_qkv import fuse_qkv
from omni_local.engine.forward.media_encoder import MediaEncoder, deepstack_levels
from omni_local.engine.forward.moe import TORCH, MoeBackend
from omni_local.engine.forward.prefill_chunks import PreparedPrompt
from omni_local.engine.forward.talker import TalkerRows
from omni_local.engine.memory.attention import AttentionKernels
from omni_local.engine.memory.host_copies import to_device
from omni_local.engine.memory.kv_store import (DEFAULT_BLOCK_TOKENS, BlockTable, GraphedKVWriter, KVShape, KVStore,
                                               KVWriter, PackedKVWriter)
from omni_local.engine.phases import ENCODE_MEDIA, phase
from omni_local.engine.prompt.builder import Prompt, build_prompt
from omni_local.errors import SettingsError
from omni_local.protocol.events import MediaCounts
from omni_local.protocol.messages import Message
from omni_local.start_up_steps import start_up_step

log = logging.getLogger(__name__)


def kv_shape(config, max_tokens: int, block_tokens: int, talker_dim: int, fp8: bool = False) -> KVShape:
    """The Thinker's KV blocks for its text model's `config`, holding `talker_dim`-wide Talker rows
    (`fp8`: keys and values in float8, kv_fp8.py)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return KVShape(config.num_hidden_layers, config.num_key_value_heads, head_dim, max_tokens, talker_dim,
                   block_tokens, fp8)


def least_kv_bytes(shape: KVShape, dtype: torch.dtype) -> int:
    """The KV of one conversation of `shape.max_tokens`, and the pad block."""
    return (shape.table_blocks + 1) * shape.block_bytes(dtype)


class ThinkerRunner:
    def __init__(
        self,
        thinker: torch.nn.Module,
        encoder: MediaEncoder,
        kv_budget_bytes: int,
        max_tokens: int,
        prefill_lengths: list[int],
        max_batch: int,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        talker_rows: TalkerRows | None = None,
        cuda_graphs: bool = False,
        compiled_layers: bool = False,
        moe: MoeBackend = TORCH,
        attention: AttentionKernels = AttentionKernels(),
        kv_fp8: bool = False,
    ) -> None:
        self.thinker = thinker
        self.attention = attention  # the kernels over the blocks; None: transformers' attention over gathered rows
        self.prefill_lengths = prefill_lengths  # the prefill graphs' new tokens (a prefill pads to the next)
        self.talker_rows = talker_rows
        self.encoder = encoder
        self.model = thinker.model  # Qwen3OmniMoeThinkerModel: .visual, .audio_tower, .language_model
        self.text = self.model.language_model
        fuse_qkv(self.text)
        shape = kv_shape(self.text.config, max_tokens, block_tokens, talker_rows.width if talker_rows else 0, kv_fp8)
        # The final norm's: never quantized, unlike lm_head under int4.
        self.device = self.text.norm.weight.device
        self.dtype = self.text.norm.weight.dtype
        self.max_batch = max_batch  # the largest decode step: the engine's seats
        need = least_kv_bytes(shape, self.dtype)
        if kv_budget_bytes < need:
            raise SettingsError(
                f"setting 'gpu_cache_bytes' ({kv_budget_bytes:,}) is below the {need:,} bytes one conversation of "
                f"'max_context_tokens' ({max_tokens}) needs: raise the first or lower the second"
            )
        self._capture_graphs = cuda_graphs and graphable(self.text.config, self.device)
        # Compiled on the GPU only: on the CPU the compile takes longer than it saves.
        self.regions = LayerRegions(compiled=compiled_layers and self.device.type == "cuda", moe=moe)
        self._deepstack_levels = len(self.model.config.vision_config.deepstack_visual_indexes)
        # Graphs under transformers' attention read whole buckets of rows, past each sequence's end
        # (KVStore's `zeroed`); the kernel reads each token's own rows only.
        reads_buckets = self._capture_graphs and (attention.decode is None or attention.prefill is None)
        self.kv = KVStore.for_budget(shape, kv_budget_bytes, self.dtype, self.device, zeroed=reads_buckets)
        self.decode_graphs: BatchGraphs | None = None  # set once captured, by warm_up
        self.prefill_graphs: BatchGraphs | None = None
        self._capture_block: BlockTable | None = None  # held while prefill graphs are left to capture

    @torch.inference_mode()
    def warm_up(self, prefill_graphs_later: bool = False) -> None:
        """A small prompt with an image and a clip through a prefill and a decode step, so the first
        request does not pay first-use costs (kernel loading, library heuristics: about 2 s for a
        first image on an H200), and captures the graphs, in blocks nobody reads. Nothing is cached.
        `prefill_graphs_later`: the prefill graphs are left to `capture_a_prefill_graph`."""
        parts = [Image.new("RGB", (64, 64), (90, 140, 200)), np.zeros(16_000, np.float32), "Hello."]
        prompt = build_prompt([Message("user", parts)], self.encoder.processor)
        table = self.kv.take(self.kv.shape.table_blocks)
        try:
            with start_up_step("the Thinker's first prefill and decode step"):
                prepared = self.prepare(prompt, 0, remember=False)
                token = int(self.prefill(table, prepared).argmax())
                self.decode([table], [token], [prompt.num_tokens], [prepared.rope_delta])
            with start_up_step("the Thinker's expert kernels at every token count"):
                self.regions.warm_up_experts(self.text.layers, max(self.prefill_lengths))
            if self._capture_graphs:
                with start_up_step("the Thinker's CUDA graphs" + (" of decode steps" if prefill_graphs_later else "")):
                    self._plan_graphs()
                    self.decode_graphs.capture(table)
                    if not prefill_graphs_later:
                        self.prefill_graphs.capture(table)
        finally:
            self.kv.pool.release(table)
        if self.prefill_graphs_left:
            self._capture_block = self.kv.take(1)

    @property
    def prefill_graphs_left(self) -> int:
        return self.prefill_graphs.uncaptured if self.prefill_graphs is not None else 0

    @torch.inference_mode()
    def capture_a_prefill_graph(self) -> None:
        """One more of the prefill graphs that `warm_up` left, writing into a block held for them
        (given back after the last); until a prefill's graph is captured, it runs eagerly."""
        self.prefill_graphs.capture(self._capture_block, 1)
        if not self.prefill_graphs_left:
            self._release_capture_block()

    def stop_capturing(self) -> None:
        """No more prefill graphs: those left run eagerly."""
        self.prefill_graphs.give_up()
        self._release_capture_block()

    def _release_capture_block(self) -> None:
        self.kv.pool.release(self._capture_block)
        self._capture_block = None

    def _plan_graphs(self) -> None:
        """The decode step for every batch of chats up to `max_batch`, and prefills of each of
        `prefill_lengths` new tokens, each for every attention length; in one memory pool."""
        pool, config = torch.cuda.graph_pool_handle(), self.text.config
        moe = self.regions.moe
        ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        capturable = partial(moe.capturable, config, self.dtype)
        self.decode_graphs = BatchGraphs(self._decode_step, self.kv, ids, capturable,
                                         batches=size_buckets(1, self.max_batch), pool=pool,
                                         kernel=self.attention.decode)
        width = (1 + self._deepstack_levels) * config.hidden_size
        dense = torch.zeros((1, 1, width), dtype=self.dtype, device=self.device)
        self.prefill_graphs = BatchGraphs(self._dense_prefill_step, self.kv, dense, capturable,
                                          lengths=self.prefill_lengths, pool=pool, kernel=self.attention.prefill,
                                          kernel_from_start=self.attention.everywhere)

    @torch.inference_mode()
    def prepare(self, prompt: Prompt, start: int, principal: str = LOCAL_USER, remember: bool = True
                ) -> PreparedPrompt:
        """Embed the tokens from `start` on; only media from there on are encoded (or taken from the
        encoder cache, `principal`'s part of it)."""
        # Positions of the whole sequence, then the tail's slice: a tail on a cached prefix gets
        # exactly the positions a cold prefill would give it.
        positions, rope_delta = mrope_positions(self.model, prompt, self.device)
        tail = to_device(prompt.input_ids[:, start:], self.device)
        embeds = self.model.get_input_embeddings()(tail)
        media = [m for m in prompt.media if m.start >= start]
        with phase(ENCODE_MEDIA):
            outputs, encoded = self.encoder.encode(media, principal, remember)
        counts = MediaCounts(in_kv=len(prompt.media) - len(media), from_cache=len(media) - encoded, encoded=encoded)
        config = self.model.config
        # Each kind's rows go to its placeholders in prompt order: a video's sound track among the
        # clips, its frames among the images (one visual mask, as transformers' DeepStack takes it).
        sounds = [o["audio"] if m.is_video else o["embeds"] for m, o in zip(media, outputs) if m.has_audio]
        if sounds:
            embeds = _scatter(embeds, tail == config.audio_token_id, torch.cat(sounds))
        visuals = [o for m, o in zip(media, outputs) if m.is_image or m.is_video]
        visual_mask, deepstack, visual_before = None, None, None
        if visuals:
            # On the host first: each chunk finds its DeepStack rows by counting there.
            visual = torch.isin(prompt.input_ids[0, start:], torch.tensor([config.image_token_id, config.video_token_id]))
            visual_before = torch.cat([torch.zeros(1, dtype=torch.long), visual.cumsum(0)])
            visual_mask = to_device(visual[None], self.device)
            embeds = _scatter(embeds, visual_mask, torch.cat([o["embeds"] for o in visuals]))
            deepstack = [level.to(embeds.dtype) for level in deepstack_levels(visuals)]
        return PreparedPrompt(start, embeds, positions[:, :, start:], rope_delta, visual_mask, deepstack,
                              prompt.input_ids[:, start:], counts, visual_before)

    @torch.inference_mode()
    def prefill(self, table: BlockTable, prepared: PreparedPrompt) -> torch.Tensor:
        """Compute `prepared` (a prompt's tail, or a part of it: `PreparedPrompt.rows`) into the blocks
        of `table`, after the `start` rows they hold, in one forward; returns the last token's logits
        [vocab]. With a Talker, each new token's Talker row is written too."""
        p, rows, graphs = prepared, self.talker_rows, self.prefill_graphs
        length = p.embeds.shape[1]
        if graphs is not None and graphs.fits(1, length, p.start):
            outputs = graphs.replay([table], self._dense_input(p), [p.start], p.positions)
        else:
            cache = self.kv.writer(table, p.start, self.attention.eager_prefill)
            outputs = self._prefill_step(cache, p.embeds, p.positions, p.visual_mask, p.deepstack)
        logits, kept = outputs if rows is not None else (outputs, None)
        if rows is not None:
            talker_rows = rows.project(p.ids, p.embeds, kept[:, :length])[0]
            self.kv.write_talker_rows(table, p.start, talker_rows)
        return logits[0]

    @property
    def packs_prefills(self) -> bool:
        """Whether several prompts' prefills are best computed in one forward (`prefill_together`): where
        prefills run eagerly. Where prefill graphs replay, each prompt's graph is kept: a packed forward
        runs eagerly, launch-bound, and a batch of graphed prefills is not built yet."""
        return self.prefill_graphs is None

    @torch.inference_mode()
    def prefill_together(self, parts: list[tuple[BlockTable, PreparedPrompt]]) -> torch.Tensor:
        """`prefill` of several prompts' tails (each into its own blocks) in one forward, their tokens
        packed in one row: the experts' weights are read once for all of them, and each token's
        numbers are those of its prompt's forward alone. Returns each one's last logits [B, vocab]."""
        caches = [self.kv.writer(table, p.start, self.attention.eager_prefill) for table, p in parts]
        prepared = [p for _, p in parts]
        lengths = [p.embeds.shape[1] for p in prepared]
        visual_mask, deepstack = _packed_deepstack(prepared)
        outputs = self._prefill_step(PackedKVWriter(caches, lengths), torch.cat([p.embeds for p in prepared], dim=1),
                                     torch.cat([p.positions for p in prepared], dim=2), visual_mask, deepstack)
        logits, kept = outputs if self.talker_rows is not None else (outputs, None)
        if kept is not None:
            for (table, p), part in zip(parts, PackedKVWriter.slices_of(lengths)):
                self.kv.write_talker_rows(table, p.start, self.talker_rows.project(p.ids, p.embeds, kept[:, part])[0])
        return logits

    def prefill_parts(self, parts: list[tuple[BlockTable, PreparedPrompt]]) -> list[torch.Tensor | Exception]:
        """Each part's last logits [vocab] (each computed into its own blocks, as by `prefill`), or the
        error its own forward raised: in one forward where prefills are packed (`prefill_together`),
        else each alone; alone too if the forward of several fails, so only a part whose own forward
        fails fails."""
        if len(parts) > 1 and self.packs_prefills:
            try:
                return list(self.prefill_together(parts))
            except Exception as error:  # noqa: BLE001 - the parts are computed one by one instead
                log.warning("prefill of %d prompts together failed (%s): computing each alone", len(parts), error)
                self.give_back_reserved(error)
        return [self._prefill_or_error(table, prepared) for table, prepared in parts]

    def _prefill_or_error(self, table: BlockTable, prepared: PreparedPrompt) -> torch.Tensor | Exception:
        try:
            return self.prefill(table, prepared)
        except Exception as error:  # noqa: BLE001 - it fails its own request, not the others'
            return error

    def give_back_reserved(self, error: Exception) -> None:
        """After a forward ran out of GPU memory, give back what it reserved."""
        if isinstance(error, torch.OutOfMemoryError) and self.device.type == "cuda":
            torch.cuda.empty_cache()

    @torch.inference_mode()
    def decode(self, tables: list[BlockTable], tokens: list[int] | torch.Tensor, indices: list[int],
               rope_deltas: list[int]) -> torch.Tensor:
        """Compute token `tokens[i]` at sequence index `indices[i]` of block table `tables[i]`, for
        every i; returns their logits [B, vocab]. `tokens` may be a tensor [B] on the device: the
        engine's, chosen by the step before and never read by the host. Graphed, this waits for the
        device nowhere (the host lists go to it through pinned memory), so the engine queues step
        after step; eager, the steps run one after another (a batch of sequences filled to different
        lengths would need a mask, and eager speed is not the point)."""
        ids = tokens if isinstance(tokens, torch.Tensor) else to_device(torch.tensor(tokens), self.device)
        positions = to_device(torch.tensor(indices) + torch.tensor(rope_deltas), self.device)
        ids, positions = ids[:, None], positions.view(1, -1, 1).expand(3, -1, -1)
        if self.decode_graphs is not None:
            return self.decode_graphs.replay(tables, ids, indices, positions)
        return torch.cat([self._decode_step(self.kv.writer(table, index, self.attention.decode), ids[i : i + 1],
                                            positions[:, i : i + 1])
                          for i, (table, index) in enumerate(zip(tables, indices))])

    def _decode_step(self, cache: KVWriter | GraphedKVWriter, ids: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
        """Logits [B, vocab] of one token per sequence (ids [B, 1], positions [3, B, 1])."""
        last, _ = run_layers(self.text, cache, self.model.get_input_embeddings()(ids), positions, regions=self.regions)
        return self._logits(last)

    def _prefill_step(self, cache: KVWriter | GraphedKVWriter, embeds: torch.Tensor, positions: torch.Tensor,
                      visual_mask: torch.Tensor | None = None, deepstack: list[torch.Tensor] | None = None
                      ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits [1, vocab] of the last of `embeds` [1, n, hidden]; with a Talker, also the hidden
        states [1, n, hidden] its rows are made from."""
        keep = self.talker_rows.accept_layer if self.talker_rows else None
        last, kept = run_layers(self.text, cache, embeds, positions, visual_mask, deepstack, keep_layer=keep,
                                regions=self.regions)
        return (self._logits(last), kept) if self.talker_rows else self._logits(last)

    def _dense_input(self, p: PreparedPrompt) -> torch.Tensor:
        """The prefill graphs' one input: the embeddings and each DeepStack level side by side,
        [1, n, (1 + levels) * hidden], a level zero at every token but the visual ones."""
        zeros = torch.zeros_like(p.embeds)
        levels = [_scatter(zeros, p.visual_mask, level) for level in p.deepstack] if p.deepstack else []
        return torch.cat([p.embeds, *levels, *[zeros] * (self._deepstack_levels - len(levels))], dim=-1)

    def _dense_prefill_step(self, cache: GraphedKVWriter, dense: torch.Tensor,
                            positions: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`_prefill_step` of a `_dense_input`: what the prefill graphs capture."""
        embeds, *levels = (part.contiguous() for part in dense.split(self.text.config.hidden_size, dim=-1))
        return self._prefill_step(cache, embeds, positions, deepstack=levels)

    def _logits(self, last: torch.Tensor) -> torch.Tensor:
        return self.thinker.lm_head(last)[:, -1].float()


def _packed_deepstack(prepared: list[PreparedPrompt]) -> tuple[torch.Tensor | None, list[torch.Tensor] | None]:
    """The visual mask [1, n_1 + ... + n_B] and DeepStack levels of packed tails: each level's rows in
    order of the tails' visual tokens, which are where the mask says (no rows for a tail without)."""
    with_levels = [p for p in prepared if p.deepstack is not None]
    if not with_levels:
        return None, None
    masks = [p.visual_mask if p.deepstack is not None else
             torch.zeros((1, p.embeds.shape[1]), dtype=torch.bool, device=p.embeds.device) for p in prepared]
    levels = [torch.cat(rows) for rows in zip(*(p.deepstack for p in with_levels))]
    return torch.cat(masks, dim=1), levels


def _scatter(embeds: torch.Tensor, placeholders: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Put encoder rows, in order, where the placeholder tokens are ([1, n] mask)."""
    return embeds.masked_scatter(placeholders.unsqueeze(-1), rows.to(embeds.dtype))
