"""The engine's parts, made once at start-up and in this order: the kernels chosen, the media
encoder and its cache, the Thinker's runner (its KV, its graphs captured), the Talker, and the
prefix cache over the KV."""

import logging
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from omni_local.engine.forward.batch_invariant import make_batch_invariant
from omni_local.engine.forward.cuda_graphs import prefill_lengths
from omni_local.engine.forward.encoders import Encoders
from omni_local.engine.forward.media_encoder import MediaEncoder
from omni_local.engine.forward.moe import moe_backend
from omni_local.engine.forward.speech import Speaker, talker_sequences
from omni_local.engine.forward.talker import TalkerRows
from omni_local.engine.forward.thinker import ThinkerRunner
from omni_local.engine.memory.attention import attention_kernels, without_cudnn_attention
from omni_local.engine.memory.encoder_cache import EncoderCache, encoder_namespace
from omni_local.engine.memory.kv_fp8 import fp8_kv
from omni_local.engine.memory.prefix_cache import PrefixCache
from omni_local.folders import keep_compiled_code_in
from omni_local.model.loader import LoadedModel
from omni_local.settings import EngineConfig
from omni_local.start_up_steps import start_up_step

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Parts:
    encoder_cache: EncoderCache | None
    runner: ThinkerRunner
    speaker: Speaker | None  # with speech on a checkpoint that has a Talker
    cache: PrefixCache


def make_parts(loaded: LoadedModel, settings: EngineConfig, warm_up_later: bool) -> Parts:
    """`warm_up_later`: capture only the decode steps' graphs now (the engine captures the prefills'
    while idle)."""
    without_cudnn_attention()  # before anything runs or is captured
    if settings.compile or loaded.device.type == "cuda":  # on a GPU our Triton kernels compile too
        keep_compiled_code_in(settings.cache_path / "compiled")
    thinker = loaded.model.thinker
    encoder_cache = _encoder_cache(thinker.model, loaded.processor, settings)
    encoder = MediaEncoder(_encoders(thinker.model, loaded.processor, settings), loaded.processor, encoder_cache)
    talker_rows = TalkerRows(loaded.model) if loaded.speech else None
    deterministic = settings.deterministic
    kv_fp8 = fp8_kv(settings.kv_dtype, loaded.device)  # the Thinker's and the Talker's KV alike
    attention = attention_kernels(settings.attention_backend, loaded.device, deterministic)
    moe = moe_backend("triton" if deterministic else settings.moe_backend, loaded.device, deterministic)
    if deterministic:
        make_batch_invariant(loaded.model, loaded.speech)
    with current_device(loaded.device):  # the graphs' streams and pools, on the model's GPU
        runner = ThinkerRunner(thinker, encoder, settings.gpu_cache_bytes, settings.max_context_tokens,
                               prefill_lengths(settings.prefill_chunk_tokens, settings.prefill_forward_tokens),
                               settings.max_running_requests,
                               settings.kv_block_tokens, talker_rows, cuda_graphs=settings.cuda_graphs,
                               compiled_layers=settings.compiled_layers, moe=moe, attention=attention,
                               kv_fp8=kv_fp8)
        runner.warm_up(prefill_graphs_later=warm_up_later)
        kv = runner.kv
        sequences = talker_sequences(kv.capacity_tokens, settings.max_context_tokens)  # as the memory plan counts
        speaker = Speaker(loaded.model, settings, sequences, moe, attention, kv_fp8) if loaded.speech else None
        if speaker is not None:
            speaker.warm_up()
    # Kept free while idle: a typical next request's blocks (a chunk of prompt and a default reply).
    headroom = kv.shape.blocks_for(settings.prefill_chunk_tokens + settings.max_new_tokens)
    cache = PrefixCache(kv, settings.host_cache_bytes, enabled=settings.prefix_cache, headroom_blocks=headroom)
    log.info("KV: %s blocks of %d tokens, %s tokens in all (%d chats of %d tokens); in host memory %s blocks",
             f"{kv.pool.usable:,}", kv.shape.block_tokens, f"{kv.capacity_tokens:,}", sequences,
             settings.max_context_tokens, f"{cache.arena.blocks:,}" if cache.arena else "none")
    return Parts(encoder_cache, runner, speaker, cache)


def current_device(device: torch.device) -> AbstractContextManager:
    """`device` as the current CUDA device meanwhile (a no-op off CUDA): CUDA events, streams and
    graph pools are made on the current device, which is cuda:0 in a new thread."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def _encoders(thinker_model: torch.nn.Module, processor: object, settings: EngineConfig) -> Encoders:
    encoders = Encoders(thinker_model, compile=settings.compile)
    if settings.compile:
        with start_up_step("the encoders"):
            encoders.warm_up(processor)  # compiled now, so the first real image does not wait
    return encoders


def _encoder_cache(thinker_model: torch.nn.Module, processor: object, settings: EngineConfig) -> EncoderCache | None:
    if not settings.encoder_cache:
        return None
    disk = settings.cache_path / "encoders" if settings.disk_cache else None
    device = next(thinker_model.parameters()).device
    namespace = encoder_namespace(thinker_model, processor)
    return EncoderCache(namespace, settings.encoder_cache_bytes, device, disk, settings.disk_cache_bytes)
