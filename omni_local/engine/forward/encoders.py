"""The vision and audio encoders, optionally with their layer stacks compiled once for every size.

transformers' encoder forwards build their helper tensors (attention segments, rotary and position
embedding tables, audio chunking) with data-dependent ops (`.tolist()`, `nonzero`, Python loops), and
split attention into one call per image or audio window in a Python loop; under `torch.compile` both
specialize the graph to each image size and clip length. Here the helpers and the cheap input
layers (patch embedding, audio convolutions) run eagerly, and only the heavy part is compiled: the
transformer layers, the mergers and the output projection, with the token dimension marked dynamic.
Attention inside is an opaque custom op whose per-segment loop runs eagerly, so neither the sizes nor
the number of images or audio windows reach the graph.

Run eagerly (`compile=False`) the same functions give bit for bit what transformers'
`get_image_features` / `get_audio_features` give.
"""

import itertools
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor, nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    apply_rotary_pos_emb_vision,
    chunk_and_pad_features,
    eager_attention_forward,
    get_audio_cu_seqlens,
    get_valid_indices,
)
from transformers.utils.generic import is_flash_attention_requested
from transformers.vision_utils import (
    get_vision_cu_seqlens,
    get_vision_interpolation_indices_and_weights,
    get_vision_position_ids,
)

from omni_local.engine.prompt.encoder_inputs import audio_inputs, image_inputs

# What warm_up encodes: a batch of each kind, so the first trace sees several segments. The graphs
# serve every size, so these need not resemble what requests send.
_WARM_UP_IMAGES = [(517, 333), (224, 224)]  # (width, height)
_WARM_UP_CLIPS = [9.0, 0.7]  # seconds: two attention windows, then one chunk


# Attention over packed segments ----------------------------------------------------------------


@torch.library.custom_op("omni_local::segment_attention", mutates_args=())
def segment_attention(
    query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, scaling: float, implementation: str
) -> Tensor:
    """[1, heads, tokens, head_dim] each -> [1, tokens, heads, head_dim]. Tokens
    cu_seqlens[i]:cu_seqlens[i+1] (an image frame, an audio window) attend to each other only."""
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
    module = _attention_module(implementation)
    if is_flash_attention_requested(requested_attention_implementation=implementation):
        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())  # the longest segment, not all tokens
        segments = dict(cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=longest, max_length_k=longest)
        return attention(module, query, key, value, None, scaling=scaling, dropout=0.0, is_causal=False, **segments)[0]
    # Segments of one length side by side (a video's frames, a clip's full windows) are one batch:
    # one attention launch for all of them instead of one each.
    outputs, start = [], 0
    for length, run in itertools.groupby((cu_seqlens[1:] - cu_seqlens[:-1]).tolist()):
        count = len(list(run))
        q, k, v = (_as_batch(t[0, :, start:start + count * length], count) for t in (query, key, value))
        out = attention(module, q, k, v, attention_mask=None, scaling=scaling, dropout=0.0, is_causal=False)[0]
        outputs.append(out.reshape(1, count * length, *out.shape[2:]))
        start += count * length
    return torch.cat(outputs, dim=1)


def _as_batch(rows: Tensor, count: int) -> Tensor:
    """[heads, count * length, head_dim] -> [count, heads, length, head_dim]: `count` segments."""
    heads, tokens, head_dim = rows.shape
    return rows.reshape(heads, count, tokens // count, head_dim).transpose(0, 1)


@segment_attention.register_fake
def _(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, scaling: float, implementation: str) -> Tensor:
    return query.new_empty(query.shape[0], query.shape[2], query.shape[1], value.shape[-1])


def _segment_bounds(cu_seqlens: Tensor, implementation: str) -> Tensor:
    """`cu_seqlens` where `segment_attention` reads it: on the device for flash attention, which takes
    it there; else on the host, read from the device once here, not by every layer's per-segment
    loop. Each such read waits for all the work queued before it, so the device then idles while
    the host queues the layer's next kernels: at full size 27 times an image or video, 32 a clip."""
    if is_flash_attention_requested(requested_attention_implementation=implementation):
        return cu_seqlens
    return cu_seqlens.cpu()


def _attention_module(implementation: str) -> SimpleNamespace:
    # What transformers' attention functions read from the encoder attention module that calls them
    # (a custom op cannot take a module); the same for every vision and audio attention.
    config = SimpleNamespace(_attn_implementation=implementation)
    return SimpleNamespace(is_causal=False, num_key_value_groups=1, training=False, config=config)


# Vision ------------------------------------------------------------------------------------------


def vision_forward(visual: nn.Module, pixels: Tensor, grid_thw: Tensor, stack: Callable) -> tuple[Tensor, list[Tensor]]:
    """transformers' `Qwen3OmniMoeVisionEncoder.forward` for `n` patches, with `stack` (`vision_stack`
    or a compiled one) for its blocks: merged tokens [n / 4, out_hidden], one such per deepstack layer."""
    indices, weights = get_vision_interpolation_indices_and_weights(
        grid_thw,
        num_grid_per_side=visual.num_grid_per_side,
        mode=visual.interpolation_mode,
        align_corners=visual.interpolation_align_corners,
        spatial_merge_size=visual.config.spatial_merge_size,
    )  # [n, 4] bilinear taps into the learned position table
    position_ids = get_vision_position_ids(grid_thw, visual.spatial_merge_size)  # [n, 2]
    # [frames + 1], one attention segment per frame
    cu_seqlens = _segment_bounds(get_vision_cu_seqlens(grid_thw), visual.blocks[0].attn.config._attn_implementation)
    hidden = visual.patch_embed(pixels)  # [n, hidden]
    pos_embeds = (visual.pos_embed(indices) * weights[:, :, None]).sum(1)
    hidden = hidden + pos_embeds.to(hidden.dtype)
    cos, sin = visual.rotary_pos_emb(hidden, position_ids)  # [n, head_dim] each
    return stack(visual, hidden, cos, sin, cu_seqlens)


def vision_stack(
    visual: nn.Module, hidden: Tensor, cos: Tensor, sin: Tensor, cu_seqlens: Tensor
) -> tuple[Tensor, list[Tensor]]:
    """The blocks, deepstack mergers and merger: [n, hidden] -> [n / 4, out_hidden] and a list of them."""
    deepstack = []
    for index, block in enumerate(visual.blocks):
        hidden = _vision_block(block, hidden, cos, sin, cu_seqlens)
        if index in visual.deepstack_visual_indexes:
            merger = visual.deepstack_merger_list[visual.deepstack_visual_indexes.index(index)]
            deepstack.append(merger(hidden))
    return visual.merger(hidden), deepstack


def _vision_block(block: nn.Module, hidden: Tensor, cos: Tensor, sin: Tensor, cu_seqlens: Tensor) -> Tensor:
    # Qwen3OmniMoeVisionBlock.forward with its attention's inlined, the per-segment loop swapped for our op.
    attn = block.attn
    tokens = hidden.shape[0]
    qkv = attn.qkv(block.norm1(hidden)).reshape(tokens, 3, attn.num_heads, -1).permute(1, 0, 2, 3)
    query, key, value = qkv.unbind(0)
    query, key = apply_rotary_pos_emb_vision(query, key, cos, sin)
    query, key, value = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
    out = segment_attention(query, key, value, cu_seqlens, attn.scaling, attn.config._attn_implementation)
    hidden = hidden + attn.proj(out.reshape(tokens, -1).contiguous())
    return hidden + block.mlp(block.norm2(hidden))


# Audio -------------------------------------------------------------------------------------------


def audio_forward(tower: nn.Module, features: Tensor, feature_mask: Tensor, stack: Callable) -> Tensor:
    """transformers' `get_audio_features` and `Qwen3OmniMoeAudioEncoder.forward`, with `stack`
    (`audio_stack` or a compiled one) for its layers: [tokens, output_dim] for all clips in order."""
    lengths = torch.sum(feature_mask, dim=1)
    packed = features.permute(0, 2, 1)[feature_mask.bool()].permute(1, 0)  # [mel, all clips' frames]
    # Each clip cut into chunks of 2 * n_window frames: [chunks, mel, longest chunk]
    padded, chunk_lengths = chunk_and_pad_features(packed, lengths, tower.n_window)
    valid_indices = get_valid_indices(chunk_lengths, tower.n_window)  # [tokens] conv rows that are not padding
    cu_seqlens = _segment_bounds(get_audio_cu_seqlens(chunk_lengths, lengths, tower.n_window_infer, tower.n_window),
                                 tower.layers[0].self_attn.config._attn_implementation)  # [windows + 1]

    padded = padded.unsqueeze(1).to(dtype=tower.conv2d1.weight.dtype)  # [chunks, 1, mel, frames]
    embeds = []
    for chunk in padded.split(tower.conv_chunksize, dim=0):  # bounds the convolutions' memory
        chunk = F.gelu(tower.conv2d1(chunk))
        chunk = F.gelu(tower.conv2d2(chunk))
        embeds.append(F.gelu(tower.conv2d3(chunk)))
    embed = torch.cat(embeds, dim=0)  # [chunks, channels, mel / 8, frames / 8]
    chunks, channels, mel, frames = embed.size()
    embed = tower.conv_out(embed.permute(0, 3, 1, 2).contiguous().view(chunks, frames, channels * mel))
    embed = embed + tower.positional_embedding.positional_embedding[:frames, :].unsqueeze(0).to(embed.dtype)
    hidden = torch.index_select(embed.reshape(-1, embed.shape[-1]), 0, valid_indices)  # [tokens, d_model]
    return stack(tower, hidden, cu_seqlens)


def audio_stack(tower: nn.Module, hidden: Tensor, cu_seqlens: Tensor) -> Tensor:
    """The encoder layers and the output projection: [tokens, d_model] -> [tokens, output_dim]."""
    for layer in tower.layers:
        hidden = _audio_layer(layer, hidden, cu_seqlens)
    hidden = tower.ln_post(hidden)
    return tower.proj2(tower.act(tower.proj1(hidden)))


def _audio_layer(layer: nn.Module, hidden: Tensor, cu_seqlens: Tensor) -> Tensor:
    # Qwen3OmniMoeAudioEncoderLayer.forward with its attention's inlined, the per-segment loop swapped for our op.
    attn = layer.self_attn
    tokens = hidden.shape[0]
    normed = layer.self_attn_layer_norm(hidden)
    query, key, value = (
        proj(normed).reshape(tokens, attn.num_heads, -1).transpose(0, 1).unsqueeze(0)
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj)
    )
    out = segment_attention(query, key, value, cu_seqlens, attn.scaling, attn.config._attn_implementation)
    hidden = hidden + attn.out_proj(out.reshape(tokens, -1).contiguous())
    hidden = hidden + layer.fc2(layer.activation_fn(layer.fc1(layer.final_layer_norm(hidden))))
    if hidden.dtype == torch.float16:
        clamp = torch.finfo(hidden.dtype).max - 1000
        hidden = torch.clamp(hidden, min=-clamp, max=clamp)
    return hidden


# The runner's interface --------------------------------------------------------------------------


class Encoders:
    """The Thinker's vision and audio encoders; with `compile`, each one's layer stack is one graph
    whose token count is dynamic, so no image size or clip length recompiles it."""

    def __init__(self, thinker_model: nn.Module, compile: bool) -> None:
        self.visual = thinker_model.visual  # Qwen3OmniMoeVisionEncoder
        self.audio_tower = thinker_model.audio_tower  # Qwen3OmniMoeAudioEncoder
        self.compiled = compile
        self._vision_stack, self._audio_stack = vision_stack, audio_stack
        if compile:
            # An image has 16 patches or more (the processor's smallest size), so its token count can be
            # backed. A clip can be a single token: unbacked, or dynamo would give that a second graph.
            self._vision_stack = _compile_for_any_size(vision_stack, unbacked_tokens=False)
            self._audio_stack = _compile_for_any_size(audio_stack, unbacked_tokens=True)

    @torch.inference_mode()
    def images(self, pixel_values: Tensor, image_grid_thw: Tensor) -> tuple[Tensor, list[Tensor]]:
        """Merged tokens [n, hidden] of all images in order, and one [n, hidden] per deepstack layer."""
        pixels = pixel_values.type(self.visual.dtype)
        return vision_forward(self.visual, pixels, image_grid_thw, self._vision_stack)

    @torch.inference_mode()
    def audio(self, input_features: Tensor, feature_attention_mask: Tensor) -> Tensor:
        """[audio tokens, hidden] of all clips in order, from the feature extractor's padded batch."""
        return audio_forward(self.audio_tower, input_features, feature_attention_mask, self._audio_stack)

    def warm_up(self, processor: Any) -> float:
        """Compile (or just run) both encoders before any request would wait for it; returns seconds."""
        start = time.perf_counter()
        device = self.visual.device
        images = [Image.new("RGB", size, (90, 140, 200)) for size in _WARM_UP_IMAGES]
        pixels = image_inputs(images, processor, device)  # as requests are preprocessed, on the device
        self.images(pixels["pixel_values"].to(device), pixels["image_grid_thw"].to(device))
        features = audio_inputs([np.zeros(int(seconds * 16_000), dtype=np.float32) for seconds in _WARM_UP_CLIPS],
                                processor)
        self.audio(features["input_features"].to(device, self.audio_tower.dtype),
                   features["feature_attention_mask"].to(device))
        return time.perf_counter() - start


def _compile_for_any_size(stack: Callable, unbacked_tokens: bool) -> Callable:
    """`stack(module, *per_token, cu_seqlens)` compiled, with its tensors' first dimension (tokens;
    segments + 1 for cu_seqlens) marked dynamic at each call."""
    # fullgraph: a graph break would mean a second graph with guards of its own.
    compiled = torch.compile(stack, fullgraph=True)
    # A backed size is specialized when it is 1 at a call; an unbacked one never is, but inductor
    # knows less about it (it mis-sizes the vision merger's reshape of an unbacked token count).
    mark_tokens = torch._dynamo.decorators.mark_unbacked if unbacked_tokens else torch._dynamo.mark_dynamic

    def call(module: nn.Module, *tensors: Tensor) -> Any:
        *per_token, cu_seqlens = tensors
        for tensor in per_token:
            mark_tokens(tensor, 0)
        torch._dynamo.mark_dynamic(cu_seqlens, 0)  # 2 or more
        return compiled(module, *tensors)

    return call
