"""The Talker's forward and its code predictor, run by us over KV we own.

What the Talker reads, as transformers' `Qwen3OmniMoeForConditionalGeneration.generate` builds it:
- a prompt of one row per token of every user turn of the conversation (a text token's Thinker
  embedding through `text_projection`, a media token's Thinker hidden state at
  `accept_hidden_layer` through `hidden_projection`), then nine rows that open the assistant turn
  (its three template tokens, padding, text-BOS and the first reply token, summed with codec
  specials that name the voice);
- then, at each step, the sum of the codec embeddings of the frame it just made plus the next reply
  token's projected embedding (text-EOS after the last one, then padding).
Each step makes the first code of a frame; the code predictor then makes the frame's other codes.
On a GPU both replay CUDA graphs captured at start-up: the step one per batch of spoken replies and
attention bucket, as the Thinker's decode step (BatchGraphs), so the steps of all the replies
speaking at once are one forward; the code predictor's 15 steps of a frame, with their sampling
on the device, one graph per batch of replies (StaticGraph), so the frames of all the replies
speaking at once are one replay too.
`TalkerRows` makes the per-token rows while the Thinker prefills, so they are kept with its KV.
"""

from dataclasses import dataclass, replace
from functools import partial

import numpy as np
import torch

from omni_local.engine.forward.cuda_graphs import BatchGraphs, StaticGraph, graphable, size_buckets
from omni_local.engine.forward.decoder_stack import LayerRegions, mrope_positions, run_layers
from omni_local.engine.forward.fused_qkv import fuse_qkv
from omni_local.engine.forward.moe import TORCH, MoeBackend
from omni_local.engine.forward.sampling import SampleBatch, Sampler, SeatSampler
from omni_local.engine.memory.attention import AttentionKernels
from omni_local.engine.memory.host_copies import Readback, to_device
from omni_local.engine.memory.kv_store import BlockTable, GraphedKVWriter, KVShape, KVStore, KVWriter
from omni_local.engine.prompt.builder import Prompt
from omni_local.errors import RequestError
from omni_local.protocol.params import SamplingParams

ASSISTANT_OPENING = 3  # <|im_start|> assistant \n
OPENING_ROWS = ASSISTANT_OPENING + 6  # the Talker's assistant rows: the opening, 4 pads, BOS, the first token


def talker_kv_shape(config, max_tokens: int, fp8: bool = False) -> KVShape:
    """The Talker's KV blocks for its text model's `config`, a sequence holding `max_tokens` rows
    (`fp8`: keys and values in float8, as the Thinker's, kv_fp8.py)."""
    return KVShape(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, max_tokens, fp8=fp8)


def talker_kv_blocks(shape: KVShape, sequences: int) -> int:
    """The Talker's KV blocks for `sequences` of its longest sequences, and the pad block."""
    return sequences * shape.table_blocks + 1


class TalkerRows:
    """The row the Talker reads for a Thinker token, made during the Thinker's prefill."""

    def __init__(self, model: torch.nn.Module) -> None:
        config = model.config
        self.accept_layer = config.talker_config.accept_hidden_layer
        self.width = config.talker_config.text_config.hidden_size
        self.text_projection = model.talker.text_projection
        self.hidden_projection = model.talker.hidden_projection
        thinker = config.thinker_config
        self._media_ids = torch.tensor([thinker.audio_token_id, thinker.image_token_id, thinker.video_token_id])

    def project(self, ids: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Rows [1, n, width] for tokens `ids` [1, n] (on the host: which are media is known there,
        without waiting for the device), from their Thinker input embeddings and hidden states at
        `accept_layer` ([1, n, thinker hidden])."""
        media = torch.isin(ids, self._media_ids)
        rows = self.text_projection(embeds)
        if media.any():
            rows = torch.where(to_device(media, rows.device).unsqueeze(-1), self.hidden_projection(hidden), rows)
        return rows


@dataclass
class TalkerPrompt:
    """The Talker's prompt for one reply; `prompt` carries its ids, media and cache keys."""

    prompt: Prompt
    user_rows: torch.Tensor  # [users, width], one per user token
    opening: torch.Tensor  # [OPENING_ROWS, width], the assistant rows
    user_positions: np.ndarray  # where each user row's token is in the Thinker's prompt

    @property
    def num_tokens(self) -> int:
        return self.prompt.num_tokens


class TalkerRunner:
    def __init__(self, model: torch.nn.Module, max_tokens: int, kv_sequences: int, cuda_graphs: bool = False,
                 compiled_layers: bool = False, moe: MoeBackend = TORCH,
                 attention: AttentionKernels = AttentionKernels(), max_batch: int = 1, kv_fp8: bool = False) -> None:
        """`max_batch`: the most spoken replies stepped in one forward (the step's largest graph);
        `kv_fp8`: the Talker's KV in float8 (the `kv_dtype` setting, as the Thinker's)."""
        self.config = model.config
        self.max_batch = max_batch
        self.attention = attention  # its prefills' and steps' kernels over the blocks, as the Thinker's
        self.talker = model.talker
        self.stack = self.talker.model
        self.predictor = self.talker.code_predictor
        fuse_qkv(self.stack)
        fuse_qkv(self.predictor.model)
        self.thinker_embeddings = model.thinker.get_input_embeddings()
        talker_config = self.config.talker_config
        text = talker_config.text_config
        self.num_code_groups = talker_config.num_code_groups
        self.device = self.talker.codec_head.weight.device
        self.dtype = self.talker.codec_head.weight.dtype
        shape = talker_kv_shape(text, max_tokens, kv_fp8)
        # The Talker's own step is a decode step like the Thinker's (about 41 ms eager at full size,
        # 5 ms graphed): BatchGraphs, whose buckets under transformers' attention read rows past
        # each new token, so the blocks it hands out are zeroed then (the kernel reads a token's own
        # rows only). Blocks for `kv_sequences` sequences of `max_tokens`, and the pad block.
        self._capture_steps = cuda_graphs and graphable(self.stack.config, self.device)
        self.kv = KVStore(shape, talker_kv_blocks(shape, kv_sequences), self.dtype, self.device,
                          zeroed=self._capture_steps and attention.decode is None)
        self.step_graphs: BatchGraphs | None = None  # set once captured, by warm_up
        # The code predictor's KV: one frame's rows (the Talker's state, then each code) for each
        # of `max_batch` replies, a frame at a time.
        predictor = self.predictor.config
        rows = KVShape(predictor.num_hidden_layers, predictor.num_key_value_heads, predictor.head_dim,
                       self.num_code_groups + 1)
        # A batch's graphs under transformers' attention read the frame's block past each reply's
        # new rows (masked): zeros until written, never what an uninitialised block holds (KVStore).
        self.predictor_kv = KVStore(rows, max_batch * rows.table_blocks + 1, self.dtype, self.device,
                                    zeroed=attention.decode is None)
        self._predictor_tables = torch.stack([self.predictor_kv.device_table(self.predictor_kv.take(rows.table_blocks))
                                              for _ in range(max_batch)])
        # 15 small steps a frame: eager, launches and host work are most of each (about 5 ms at full
        # size against 0.8 ms graphed, ../shared/BENCHMARK_ANCHORS.md). All 15, their sampling on the
        # device included, are one graph: the host reads the codes once a frame, not once a code. A
        # graph per bucket of replies (as the Talker's step), so that 16 speaking replies replay one
        # graph a frame, not 16.
        self._capture_predictor = cuda_graphs and self.device.type == "cuda"
        self.frame_graphs: dict[int, StaticGraph] = {}  # by bucket of replies; set once captured, by warm_up
        # The code predictor's sampling rows, one per reply of a frame's batch: a reply's parameters
        # and seed are loaded into its row at each frame (the rows are the batch's, not the
        # reply's), at fixed addresses the frames' graphs read.
        self.predictor_sampler = SeatSampler(max_batch, self.predictor.config.vocab_size, self.device)
        self._predictor_seats = torch.arange(max_batch, device=self.device)
        self._batch_writers: dict[tuple[int, int], GraphedKVWriter] = {}  # by (group, batch): made once
        # Each step's rows are the same in every frame, so their rotary embedding is made once here,
        # not by a few kernels at each of a frame's 15 steps
        with torch.inference_mode():
            self._predictor_rotary = [self._rotary_at(group) for group in range(self.num_code_groups - 1)]
        self._row_zero = torch.zeros(1, dtype=torch.long, device=self.device)
        # The Talker's and the code predictor's layers, as the Thinker's (on the GPU only).
        self.regions = LayerRegions(compiled=compiled_layers and self.device.type == "cuda", moe=moe)
        self.voices = {name.lower(): int(i) for name, i in talker_config.speaker_id.items()}
        self.codec_eos = talker_config.codec_eos_token_id
        vocab = text.vocab_size
        # As transformers' generate: the codec block's specials are never chosen, except EOS.
        self.suppressed = torch.tensor(
            [i for i in range(vocab - 1024, vocab) if i != self.codec_eos], device=self.device
        )
        with torch.inference_mode():
            special = [self.config.tts_bos_token_id, self.config.tts_eos_token_id, self.config.tts_pad_token_id]
            self.tts_bos, self.tts_eos, self.tts_pad = self.project_text(special).split(1)
            codec = [talker_config.codec_nothink_id, talker_config.codec_think_bos_id, talker_config.codec_think_eos_id]
            self._codec_opening = self.stack.codec_embedding(torch.tensor(codec, device=self.device))
            self._codec_tail = self.stack.codec_embedding(
                torch.tensor([talker_config.codec_pad_id, talker_config.codec_bos_id], device=self.device)
            )

    @torch.inference_mode()
    def warm_up(self) -> list[int]:
        """A short prompt, its first code drawn greedily and sampled, one frame and one step in blocks
        nobody reads, and the experts' kernels for prompts of every length, so the first spoken reply
        does not pay first-use costs (such as compiling the draw's kernel), then the
        code predictor's and the step's graphs; returns the frame's codes."""
        table = self.kv.take(self.kv.shape.table_blocks)
        try:
            # contiguous, as a real prompt's embeddings are: the compiled layers would compile a
            # graph for the expanded view's zero strides that no real prefill uses
            prompt = self.tts_pad.expand(4, -1)[None].contiguous()
            positions = torch.arange(4, device=self.device).expand(3, 1, -1)
            hidden, logits = self._forward(self.kv.writer(table, 0, self.attention.eager_prefill), prompt, positions)
            for params in (SamplingParams(), SamplingParams(temperature=1.0)):  # the first code's draw, both ways
                Sampler(params, seed=0, suppressed=self.suppressed).next_token(logits[0])
            frames, codec_sum = self.complete_frames(hidden, self._row_zero, [SamplingParams()], seeds=[0], frames=[0])
            codes = frames[0].tolist()
            self.steps([table], [4], codec_sum + self.tts_pad, [0])
            # A prompt's prefill runs eagerly at its own length, up to a whole sequence.
            self.regions.warm_up_experts(self.stack.layers, self.kv.shape.max_tokens)
            if self._capture_predictor:
                self._capture_frames(hidden.shape[-1])
            if self._capture_steps:
                row = self.tts_pad[None]  # [1, 1, width], shaped as a step's input
                capturable = partial(self.regions.moe.capturable, self.stack.config, self.dtype)
                self.step_graphs = BatchGraphs(self._forward, self.kv, row, capturable,
                                               batches=size_buckets(1, self.max_batch), kernel=self.attention.decode)
                self.step_graphs.capture(table)
            return codes
        finally:
            self.kv.pool.release(table)

    def voice_id(self, voice: str) -> int:
        """The codec id of `voice` (any case); a `RequestError` listing the voices otherwise."""
        found = self.voices.get(voice.lower())
        if found is None:
            names = ", ".join(sorted(name.capitalize() for name in self.voices))
            raise RequestError(f"unknown voice '{voice}': this model speaks as {names}")
        return found

    @torch.inference_mode()
    def project_text(self, ids: list[int]) -> torch.Tensor:
        """[len(ids), width]: text tokens as the Talker reads them."""
        embeds = self.thinker_embeddings(to_device(torch.tensor(ids), self.device))
        return self.talker.text_projection(embeds)

    def build_prompt(
        self, thinker: Prompt, user_rows: torch.Tensor, user_positions: np.ndarray, first_token: int, voice: int
    ) -> TalkerPrompt:
        """The Talker's prompt for a reply to `thinker` that begins with `first_token`."""
        ids = thinker.input_ids[0]
        opening_ids = ids[-ASSISTANT_OPENING:].tolist()
        text = torch.cat([self.project_text(opening_ids), self.tts_pad.expand(4, -1), self.tts_bos,
                          self.project_text([first_token])])
        zeros = self._codec_opening.new_zeros(ASSISTANT_OPENING, self._codec_opening.shape[1])
        voice_row = self.stack.codec_embedding(to_device(torch.tensor([voice]), self.device))
        codec = torch.cat([zeros, self._codec_opening, voice_row, self._codec_tail])
        # The ids only place the media for the 3D positions; the assistant rows' ids are padding.
        talker_ids = torch.cat([ids[user_positions], ids.new_full((len(text),), self.config.tts_pad_token_id)])
        keys = np.concatenate([thinker.keys[user_positions], talker_ids[len(user_positions):].numpy()])
        in_user_turns = set(user_positions.tolist())
        media = [replace(m, start=int(np.searchsorted(user_positions, m.start)))
                 for m in thinker.media if m.start in in_user_turns]
        prompt = Prompt(talker_ids[None], media, keys)
        return TalkerPrompt(prompt, user_rows, text + codec, user_positions)

    @torch.inference_mode()
    def prefill(self, table: BlockTable, talker: TalkerPrompt, start: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Compute the prompt from `start` on (the rows before are in the blocks of `table`). Returns the
        last hidden state [1, 1, width], its codec logits [vocab] and the rope delta of later steps."""
        positions, rope_delta = mrope_positions(self.talker, talker.prompt, self.device)
        rows = torch.cat([talker.user_rows, talker.opening])[start:]
        hidden, logits = self._forward(self.kv.writer(table, start, self.attention.eager_prefill), rows[None],
                                       positions[:, :, start:])
        return hidden, logits[0], rope_delta

    @torch.inference_mode()
    def steps(self, tables: list[BlockTable], indices: list[int], embeds: torch.Tensor, rope_deltas: list[int]
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """One step of each spoken reply: reply i's at row `indices[i]` of `tables[i]` from `embeds[i]`
        ([n, 1, width]). Returns their hidden states [n, 1, width] and codec logits [n, vocab].
        Graphed, one replay for them all (the Talker's weights read once, not once a reply); eager,
        one after another, each exactly as alone."""
        positions = to_device(torch.tensor(indices) + torch.tensor(rope_deltas), self.device)
        positions = positions.view(1, -1, 1).expand(3, -1, -1)
        if self.step_graphs is not None:
            return self.step_graphs.replay(tables, embeds, indices, positions)
        steps = [self._forward(self.kv.writer(table, index, self.attention.decode), embeds[i : i + 1],
                               positions[:, i : i + 1]) for i, (table, index) in enumerate(zip(tables, indices))]
        return torch.cat([hidden for hidden, _ in steps]), torch.cat([logits for _, logits in steps])

    @torch.inference_mode()
    def complete_frames(self, hidden: torch.Tensor, first_codes: torch.Tensor, params: list[SamplingParams],
                        seeds: list[int], frames: list[int]) -> tuple[list[Readback], torch.Tensor]:
        """The code predictor's codes for the rest of a frame of each of n replies (at most
        `max_batch`): reply i's frame `frames[i]`, after the Talker's `first_codes[i]` ([n], on the
        device, unread) from `hidden[i]` ([n, 1, width]), sampled by `params[i]` with the reply's
        `seeds[i]`. Returns each reply's 16 codes, the first included, on their way to the host
        (read them once, when wanted), and the sums of each frame's code embeddings [n, 1, width]
        (the next steps' input, before the text rows are added). Graphed, one replay for them all
        (the predictor's weights read once, not once a reply); eager, one after another, each
        exactly as alone. Nothing here waits for the device."""
        count, groups = len(params), self.num_code_groups - 1
        start = torch.cat([hidden, self.stack.codec_embedding(first_codes.view(count, 1))], dim=1)
        sampler = self.predictor_sampler
        for seat, (reply_params, seed) in enumerate(zip(params, seeds)):
            sampler.start(seat, reply_params, seed)
        # Row `seat` of each group's keys: that reply's draw of the group's code in its frame.
        batch = sampler.batch([seat for _ in range(groups) for seat in range(count)],
                              [frame * groups + group for group in range(groups) for frame in frames])
        keys = batch.keys.view(groups, count)
        if self.frame_graphs:
            bucket = min(size for size in self.frame_graphs if size >= count)
            padded = (torch.cat([start, start.new_zeros((bucket - count, *start.shape[1:]))]),
                      torch.cat([keys, keys.new_zeros((groups, bucket - count))], dim=1))
            codes, sums = (out[:count] for out in self.frame_graphs[bucket].replay(*padded))
        else:
            each = [self._frame(start[i : i + 1], keys[:, i : i + 1], batch.sampling, seat=i) for i in range(count)]
            codes, sums = torch.cat([codes for codes, _ in each]), torch.cat([sums for _, sums in each])
        return [Readback(torch.cat([first_codes[i : i + 1], codes[i]])) for i in range(count)], sums

    def _capture_frames(self, width: int) -> None:
        """The frames' graphs, one per bucket of replies, the largest first, in one memory pool (a
        frame's batches never run at once). Captured sampling: greedy rows still take the argmax, a
        graph serves both."""
        pool = torch.cuda.graph_pool_handle()
        groups = self.num_code_groups - 1
        for bucket in reversed(size_buckets(1, self.max_batch)):
            start = torch.zeros((bucket, 2, width), dtype=self.dtype, device=self.device)
            keys = torch.zeros((groups, bucket), dtype=torch.long, device=self.device)
            self.frame_graphs[bucket] = StaticGraph(partial(self._frame, sampling=True), [start, keys], pool)

    def _frame(self, start: torch.Tensor, keys: torch.Tensor, sampling: bool, seat: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The code predictor's 15 steps of a frame of B replies from `start` [B, 2, width] (the
        Talker's hidden states, the first codes' embeddings), each code chosen on the device by
        `predictor_sampler`'s rows 0 to B - 1 with the random keys `keys[group]` ([15, B]): the codes
        [B, 15] and the sums of all 16 codes' embeddings [B, 1, width]. `seat`: one reply alone, in
        that sampling row and KV table, eagerly. Nothing here waits for the device: the whole frame
        is one graph."""
        model, table = self.predictor.model, self.predictor_sampler
        seats = self._predictor_seats[:len(start)] if seat is None else self._predictor_seats[seat : seat + 1]
        embeds, codes, step_input = [start[:, 1:]], [], start
        for group in range(self.num_code_groups - 1):
            logits = self._predict_step(group, step_input, seat)
            code = table.sample(logits, SampleBatch(seats, keys[group], sampling))
            codes.append(code)
            step_input = model.codec_embedding[group](code[:, None])
            embeds.append(step_input)
        # One sum over the stacked rows, as transformers does it (the order of float additions matters).
        return torch.stack(codes, dim=1), torch.cat(embeds, dim=1).sum(1, keepdim=True)

    def _predict_step(self, group: int, step_input: torch.Tensor, seat: int | None) -> torch.Tensor:
        """Logits [B, vocab] of the frame's code `group + 1`, from `step_input` [B, n, width]: the
        hidden states and first codes (rows 0 and 1) for group 0, else code `group` (row group + 1);
        reply b's rows in KV table b, or in table `seat` for one reply alone."""
        # The decode kernel reads the frame's rows in place: one launch a layer, where transformers'
        # attention would gather the rows, make a mask and attend (a frame is 15 steps of 5 layers)
        cache = (self.predictor_kv.writer(self._predictor_tables[seat], _predictor_row(group), self.attention.decode)
                 if seat is not None else self._batch_writer(group, len(step_input)))
        last, _ = run_layers(self.predictor.model, cache, step_input, None, regions=self.regions,
                             rotary=self._predictor_rotary[group])
        return self.predictor.lm_head[group](last)[:, -1].float()

    def _batch_writer(self, group: int, batch: int) -> GraphedKVWriter:
        """The cache of step `group` of a frame of `batch` replies, reply b's rows in KV table b:
        made at the first frame of that batch (a graph's eager run before its capture), so a graph
        reads the places, never computes them."""
        key = (group, batch)
        if key not in self._batch_writers:
            row, length = _predictor_row(group), 2 if group == 0 else 1
            tables = self._predictor_tables[:batch]
            indices = torch.arange(row, row + length, device=self.device).expand(batch, -1).contiguous()
            block_tokens = self.predictor_kv.shape.block_tokens
            blocks = tables[:, indices[0] // block_tokens].contiguous()
            offsets = (indices % block_tokens).contiguous()
            last = torch.full((batch,), length - 1, device=self.device)
            self._batch_writers[key] = GraphedKVWriter(self.predictor_kv, tables, indices, blocks, offsets, last,
                                                       row + length, self.attention.decode)
        return self._batch_writers[key]

    def _rotary_at(self, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The code predictor's rotary embedding (cos, sin) of the rows step `group` writes."""
        row, rows = _predictor_row(group), 2 if group == 0 else 1
        like = torch.empty((1, rows, self.predictor.config.hidden_size), dtype=self.dtype, device=self.device)
        return self.predictor.model.rotary_emb(like, torch.arange(row, row + rows, device=self.device)[None])

    def _forward(self, cache: KVWriter | GraphedKVWriter, embeds: torch.Tensor,
                 positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The last hidden state [1, 1, width] and its codec logits [1, vocab] of `embeds` [1, n, width]
        at `positions` [3, 1, n]; with n = 1, what the step's graphs capture."""
        hidden, _ = run_layers(self.stack, cache, embeds, positions, regions=self.regions)
        return hidden, self.talker.codec_head(hidden)[:, -1].float()


def _predictor_row(group: int) -> int:
    """The first row of a frame the code predictor's step `group` writes: rows 0 and 1 (the Talker's
    hidden state and the first code) for group 0, row group + 1 (code `group`) after."""
    return 0 if group == 0 else group + 1


def user_positions(ids: torch.Tensor, im_start: int, user: int) -> np.ndarray:
    """Indices of the tokens of user turns (from a turn's <|im_start|> up to the next one), the rule
    transformers uses to pick the Talker's prompt rows."""
    ids = ids.numpy()
    index = np.arange(len(ids))
    turn_start = np.maximum.accumulate(np.where(ids == im_start, index, -1)).clip(min=0)
    role = ids[np.minimum(turn_start + 1, len(ids) - 1)]
    return np.flatnonzero(role == user)
