"""Spoken replies: the Talker and Code2Wav, stepped by the engine between the Thinker's steps.

A reply's speech starts once the Thinker has its first token: the Talker's prompt is built from the
rows the Thinker kept for every user token (`TalkerRows`), so a cached prompt needs no Thinker
recompute. Each engine turn then makes at most one frame: a Talker step on the last frame's codes
plus the next reply token's row (waiting while the Thinker has not written that token yet) gives
the frame's first code, the code predictor its other codes, and Code2Wav turns whole chunks of
frames into audio. Once the first audio is out, a frame is read the turn after it is queued, so the
device always holds work while the host makes the next turn. The Talker's own KV
of the user turns is kept per session (a second prefix cache), so a later spoken turn computes
only the new user turn and the assistant opening. Its keys are the user turns' tokens, but a
medium's row is the Thinker's hidden state there, which the whole Thinker prompt before it shapes
(the system prompt, earlier replies): reuse is also cut where the Thinker prompt the rows were
made from stops agreeing with the reply's own.
"""

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from omni_local.engine.forward.moe import TORCH, MoeBackend
from omni_local.engine.forward.sampling import Sampler
from omni_local.engine.forward.talker import (OPENING_ROWS, TalkerPrompt, TalkerRunner, talker_kv_blocks,
                                              talker_kv_shape, user_positions)
from omni_local.engine.forward.vocoder import AudioStream, Vocoder
from omni_local.engine.memory.attention import AttentionKernels
from omni_local.engine.memory.host_copies import Readback, to_device
from omni_local.engine.memory.kv_store import BlockTable, KVStore
from omni_local.engine.memory.prefix_cache import Claim, Match, PrefixCache, common_prefix
from omni_local.engine.prompt.builder import Prompt
from omni_local.protocol.events import SPEECH_SAMPLE_RATE, SpeechReport
from omni_local.protocol.params import SamplingParams, SpeechParams
from omni_local.settings import EngineConfig
from omni_local.start_up_steps import start_up_step


@dataclass(frozen=True)
class MadeFrom:
    """The Thinker prompt a session's cached Talker rows were made from: its keys and media digests."""

    keys: np.ndarray
    media: dict[int, bytes]  # start -> full digest

    @classmethod
    def of(cls, prompt: Prompt) -> "MadeFrom":
        return cls(prompt.keys.copy(), {item.start: item.digest for item in prompt.media})


@dataclass
class SpokenReply:
    """One reply's speech, owned by the engine's worker."""

    params: SpeechParams
    principal: str  # whose (access.py): its Talker rows are matched among this principal's alone
    session: str
    thinker: Prompt  # the Thinker's prompt, whose rows the Talker reads
    prompt: TalkerPrompt
    sampler: Sampler  # the Talker's: each frame's first code
    seed: int  # the code predictor's draws' (its sampling row is the Talker runner's)
    claim: Claim | None = None  # the session's Talker cache entry and its blocks, from the prefill to the end
    reused: int = 0  # Talker rows its prefill found in the session's cache
    codec_sum: torch.Tensor | None = None  # the last queued frame's summed code embeddings: the next input
    written: int = 0  # Talker KV rows in its blocks
    queued: int = 0  # frames queued on the device (the Talker's forward and the code predictor's)
    unread: Readback | None = None  # the codes of the last frame queued, until the host reads them
    due: Readback | None = None  # the frame queued the turn before, read this turn (`frame_out`)
    rope_delta: int = 0
    stream: AudioStream = field(default_factory=AudioStream)
    done: bool = False
    first_audio_at: float = 0.0
    last_audio_at: float = 0.0

    @property
    def table(self) -> BlockTable:
        return self.claim.entry.table

    @property
    def begun(self) -> bool:
        """Its first frame is queued (the Talker's prefill): the next ones are steps."""
        return self.queued > 0

    def report(self, submitted_at: float) -> SpeechReport:
        audio_s = self.stream.sent / SPEECH_SAMPLE_RATE
        rtf = (self.last_audio_at - submitted_at) / audio_s if audio_s else 0.0
        first = self.first_audio_at - submitted_at if self.first_audio_at else 0.0
        return SpeechReport(self.params.voice, len(self.stream.frames), audio_s, first, rtf,
                            self.prompt.num_tokens, self.reused)


def talker_sequences(thinker_tokens: int, max_context_tokens: int) -> int:
    """The Talker's longest sequences its KV holds beside Thinker KV of `thinker_tokens`: as many as
    those hold chats of `max_context_tokens`."""
    return thinker_tokens // max_context_tokens


def talker_kv_bytes(model: torch.nn.Module, settings: EngineConfig, thinker_tokens: int, dtype: torch.dtype) -> int:
    """The bytes of the Talker's KV beside Thinker KV of `thinker_tokens` (its blocks, and the pad block)."""
    shape = talker_kv_shape(model.config.talker_config.text_config, talker_sequence_rows(settings, model.code2wav),
                            settings.kv_dtype == "fp8")
    sequences = talker_sequences(thinker_tokens, settings.max_context_tokens)
    return talker_kv_blocks(shape, sequences) * shape.block_bytes(dtype)


def talker_sequence_rows(settings: EngineConfig, code2wav: torch.nn.Module) -> int:
    """The rows of the Talker's longest sequence: every user token of a full context, the assistant
    rows and the frames."""
    return settings.max_context_tokens + OPENING_ROWS + max_frames(settings, code2wav)


def max_frames(settings: EngineConfig, code2wav: torch.nn.Module) -> int:
    """The frames of the longest spoken reply, `max_speech_seconds`."""
    return max(1, round(settings.max_speech_seconds * SPEECH_SAMPLE_RATE / int(code2wav.total_upsample)))


class Speaker:
    """The engine's speech part: the Talker runner, its KV cache, and Code2Wav."""

    def __init__(self, model: torch.nn.Module, settings: EngineConfig, kv_sequences: int, moe: MoeBackend = TORCH,
                 attention: AttentionKernels = AttentionKernels(), kv_fp8: bool = False) -> None:
        self.vocoder = Vocoder(model.code2wav, settings.first_audio_frames, settings.audio_chunk_frames,
                               settings.audio_left_context_frames, cuda_graphs=settings.cuda_graphs)
        self.max_frames = max_frames(settings, model.code2wav)
        self.runner = TalkerRunner(model, talker_sequence_rows(settings, model.code2wav), kv_sequences,
                                   cuda_graphs=settings.cuda_graphs, compiled_layers=settings.compiled_layers,
                                   moe=moe, attention=attention, max_batch=settings.max_running_requests,
                                   kv_fp8=kv_fp8)
        # Talker KV of user turns is small; an entry pushed off the device is dropped, not moved.
        self.cache = PrefixCache(self.runner.kv, 0, enabled=settings.prefix_cache, by_hash=False)
        self.im_start, self.user = model.config.im_start_token_id, model.config.user_token_id
        self._made_from: dict[tuple[str, str], MadeFrom] = {}  # an entry's owner -> what it was made from

    def warm_up(self) -> None:
        """The Talker, its code predictor and Code2Wav once each, caching nothing; on a GPU their
        graphs are captured."""
        with start_up_step("the Talker and its code predictor"):
            frame = self.runner.warm_up()
        with start_up_step("Code2Wav"):
            self.vocoder.warm_up(frame)

    @property
    def voices(self) -> list[str]:
        return sorted(name.capitalize() for name in self.runner.voices)

    def check(self, params: SpeechParams) -> None:
        self.runner.voice_id(params.voice)

    @torch.inference_mode()
    def begin(
        self, params: SpeechParams, principal: str, session: str, seed: int, prompt: Prompt, first_token: int,
        kv: KVStore, table: BlockTable
    ) -> SpokenReply:
        """Speech for a reply to `prompt` that begins with `first_token`; the Thinker's Talker rows
        are read now from the blocks of `table`, which it may give up before the Talker starts."""
        positions = user_positions(prompt.input_ids[0], self.im_start, self.user)
        rows = kv.read_talker_rows(table, to_device(torch.from_numpy(positions), kv.device))
        voice = self.runner.voice_id(params.voice)
        talker_prompt = self.runner.build_prompt(prompt, rows, positions, first_token, voice)
        return SpokenReply(params, principal, session, prompt, talker_prompt,
                           Sampler(params.talker_sampling(), seed + 1, suppressed=self.runner.suppressed), seed + 2)

    @torch.inference_mode()
    def queue_first_frame(self, reply: SpokenReply) -> None:
        """`reply`'s first frame queued, waiting for nothing: the Talker's prefill, once its blocks
        are had (else nothing, and again next turn), and the code predictor's codes."""
        hidden, logits = self._start(reply)
        if hidden is None:
            return  # running replies hold the Talker's blocks: try again next turn
        # Every spoken reply has at least one frame (transformers' `talker_min_new_tokens=1`).
        eos = to_device(torch.tensor([self.runner.codec_eos]), logits.device)
        self._complete_frames([reply], hidden, logits.index_fill(0, eos, float("-inf"))[None])

    @torch.inference_mode()
    def queue_frames(self, texts: list[tuple[SpokenReply, list[int], bool]]) -> None:
        """At most one more frame of each reply whose first is queued, waiting for nothing: `texts`
        gives each with its reply's tokens so far and whether its text is done. The Talker's steps of
        all of them are one forward (in groups of the runner's `max_batch`), then their code
        predictor's frames another. The frame each queued the turn before becomes due (`frame_out`
        reads it)."""
        stepping = []
        for reply, reply_ids, text_done in texts:
            reply.due, reply.unread = reply.unread, None
            if reply.queued >= self.max_frames:
                continue
            # The frame this step begins reads the reply token of the same index.
            text_row = self._text_row(reply.queued, reply_ids, text_done)
            if text_row is not None:  # else the Thinker has not written that token yet
                stepping.append((reply, reply.codec_sum + text_row))
        for start in range(0, len(stepping), self.runner.max_batch):
            self._queue_steps(stepping[start : start + self.runner.max_batch])

    def frame_out(self, reply: SpokenReply) -> tuple[np.ndarray, list[list[int]]] | None:
        """The frame due read and kept; returns the audio chunk that completes, if one, with its
        frames' codes. Until the first audio, the frame queued this turn is also read now, so the
        first chunk goes out as soon as its frames exist. Reading a frame a turn late keeps one
        queued on the device while the host makes the next turn (the engine's loop, the Thinker's
        step, Code2Wav), where reading it at once left the device idle then; a frame queued after
        the one that ends the speech is dropped."""
        due, reply.due = reply.due, None
        if due is not None:
            self._keep(reply, due.tolist())
        if reply.unread is not None and (reply.done or not reply.first_audio_at):
            # Before the first audio, read at once; after the end of the speech, dropped.
            unread, reply.unread = reply.unread, None
            if not reply.done:
                self._keep(reply, unread.tolist())
        if not self.vocoder.due(reply.stream, final=reply.done):
            return None
        start = reply.stream.decoded
        samples = self.vocoder.decode(reply.stream)
        now = time.perf_counter()
        reply.first_audio_at = reply.first_audio_at or now
        reply.last_audio_at = now
        return samples, reply.stream.frames[start:]

    def _queue_steps(self, stepping: list[tuple[SpokenReply, torch.Tensor]]) -> None:
        """The Talker's step of each reply in `stepping` (with its input row) in one forward, then
        their code predictor's frames in another."""
        replies = [reply for reply, _ in stepping]
        hidden, logits = self.runner.steps([r.table for r in replies], [r.written for r in replies],
                                           torch.cat([row for _, row in stepping]), [r.rope_delta for r in replies])
        for reply in replies:
            reply.written += 1
        self._complete_frames(replies, hidden, logits)

    def _complete_frames(self, replies: list[SpokenReply], hidden: torch.Tensor, logits: torch.Tensor) -> None:
        """Each reply's frame: its first code drawn from the Talker's `logits[i]` ([n, vocab]) by
        the reply's own sampler, then the code predictor's codes from its `hidden[i]` state ([n, 1,
        width]): the frames are queued, their codes unread. (Whether one ends the speech is known
        when its codes are read.)"""
        firsts = torch.cat([reply.sampler.next_token(logits[i]) for i, reply in enumerate(replies)])
        frames, sums = self.runner.complete_frames(hidden, firsts, [predictor_sampling(r.params) for r in replies],
                                                   [r.seed for r in replies], [r.queued for r in replies])
        for i, (reply, codes) in enumerate(zip(replies, frames)):
            reply.unread, reply.codec_sum = codes, sums[i : i + 1]
            reply.queued += 1

    def _keep(self, reply: SpokenReply, codes: list[int]) -> None:
        """A frame's codes, read: kept, or the end of the speech."""
        if codes[0] == self.runner.codec_eos:
            reply.done = True
        else:
            reply.stream.frames.append(codes)
            reply.done = len(reply.stream.frames) >= self.max_frames

    def end(self, reply: SpokenReply) -> None:
        """Give the Talker's blocks back, once; the user turns' KV stays for the session's next spoken
        turn. A frame still queued on the device writes its row before any later forward's."""
        if reply.claim is not None:
            self.cache.release(reply.claim)
            reply.claim = None

    def _start(self, reply: SpokenReply) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The Talker's prefill, after what its cache holds: the last hidden state and logits, or
        Nones while too few of the Talker's blocks are free."""
        prompt = reply.prompt.prompt
        rows = prompt.num_tokens + self.max_frames
        match = self._made_alike(reply, self.cache.match(prompt, principal=reply.principal))
        reply.claim = self.cache.claim(reply.session, prompt, match, rows, principal=reply.principal)
        if reply.claim is None:
            return None, None
        # From the claim on, the session's entry holds rows that agree with this reply's Thinker
        # prompt; sessions whose entries the cache has dropped are forgotten here too.
        self._made_from = {o: m for o, m in self._made_from.items() if o in self.cache.entries}
        self._made_from[reply.claim.entry.owner] = MadeFrom.of(reply.thinker)
        reply.reused = reply.claim.start
        hidden, logits, reply.rope_delta = self.runner.prefill(reply.table, reply.prompt, reply.claim.start)
        reply.written = prompt.num_tokens
        self.cache.publish(reply.claim, prompt, [], len(reply.prompt.user_rows))
        return hidden, logits

    def _made_alike(self, reply: SpokenReply, match: Match) -> Match:
        """`match` cut to the user rows made from the same Thinker prefix as the reply's own."""
        made_from = self._made_from.get(match.entry.owner) if match.entry is not None else None
        if made_from is None:
            return Match(None, 0)
        limit = min(len(made_from.keys), reply.thinker.num_tokens)
        agreed = common_prefix(made_from.keys, made_from.media, reply.thinker, limit)
        rows = int(np.searchsorted(reply.prompt.user_positions, agreed))  # user rows before `agreed`
        return Match(match.entry, min(match.length, rows))

    def _text_row(self, index: int, reply_ids: list[int], text_done: bool) -> torch.Tensor | None:
        """What the Talker reads with frame `index`: reply token `index`, text-EOS in place of the
        last token (transformers never embeds the last one), then padding; None while unwritten."""
        if index < len(reply_ids):
            last = text_done and index == len(reply_ids) - 1
            return self.runner.tts_eos if last else self.runner.project_text([reply_ids[index]])
        return self.runner.tts_pad if text_done else None


def predictor_sampling(params: SpeechParams) -> SamplingParams:
    # What transformers' Talker passes its code predictor when sampling.
    return SamplingParams() if params.temperature == 0 else SamplingParams(temperature=1.0, top_k=50, top_p=0.8)
