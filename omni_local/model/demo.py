"""A tiny Qwen3-Omni checkpoint built offline, so the app and the tests run with no download.

Same architecture and token conventions as Qwen3-Omni-30B-A3B-Instruct, scaled down to a few MB with
seeded random weights: the replies are noise, but every code path (chat template, processor,
encoders, M-RoPE, MoE, Talker, Code2Wav) runs as it would on the real model. Its files are laid out
as transformers 5 saves a checkpoint; the tests also write it in Qwen's own, older layout
(tests/support/checkpoint_layouts.py).
"""

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    Qwen2Tokenizer,
    Qwen2VLImageProcessorPil,
    Qwen3OmniMoeConfig,
    Qwen3OmniMoeForConditionalGeneration,
    WhisperFeatureExtractor,
)
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from omni_local.errors import CheckpointError
from omni_local.folders import make_folders
from omni_local.model.chat_template import CHAT_TEMPLATE
from omni_local.model.workarounds import init_talker_experts

# Bump when anything below changes what is written: an old demo folder is then rebuilt.
BUILDER_VERSION = "2"
MARKER_FILE = "omni_local_demo.json"

_SEED = 1234
# Large enough that greedy decoding from random weights does not collapse onto one token.
_INIT_STD = 0.25

# Qwen's special tokens in the real vocabulary's order (so with the same relative ids), placed
# after the ordinary tokens as there.
# fmt: off
_SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
    "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
    "</tool_response>", "<think>", "</think>", "<|audio_start|>", "<|audio_end|>", "<tts_pad>",
    "<tts_text_bos>", "<tts_text_eod>", "<tts_text_bos_single>", "<|audio_pad|>",
]
# fmt: on
# Markup the model writes as text (Qwen marks these non-special, so decoding keeps them).
_TEXT_MARKUP = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}
_NAMED_TOKENS = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "audio_token": "<|audio_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}
# The Talker reads the role words as single tokens right after <|im_start|>.
_ROLE_WORDS = ("system", "user", "assistant")

_CORPUS = """\
system
You are a helpful assistant. Answer the user in a few clear words.
user
What is in this picture? Please describe the image in one sentence.
assistant
I see a red house, a green tree and a blue sky above a quiet street.
user
What can you hear in this sound?
assistant
I hear a dog barking, a bell ringing and people talking nearby.
user
Tell me a short story about a cat who learns to sing.
assistant
The quick brown fox jumps over the lazy dog, and the cat sings a song at noon.
user
How is the weather today?
assistant
It is sunny and warm, with a light wind from the west and a few clouds.
Numbers like 1, 2, 3, 10, 42 and 2025 appear in text, and so do commas, dots, colons: and dashes -.
"""

# Token ids of the full-size model's codec vocabulary sit in its last 1024 ids (which generation
# suppresses, except EOS); the tiny one keeps each id's offset inside that block.
_CODEBOOK_SIZE = 64
_TALKER_VOCAB = _CODEBOOK_SIZE + 1024
_CODEC_BLOCK = _TALKER_VOCAB - 1024
_CODEC_IDS = {
    "codec_pad_id": _CODEC_BLOCK + 100,
    "codec_bos_id": _CODEC_BLOCK + 101,
    "codec_eos_token_id": _CODEC_BLOCK + 102,
    "codec_nothink_id": _CODEC_BLOCK + 107,
    "codec_think_bos_id": _CODEC_BLOCK + 108,
    "codec_think_eos_id": _CODEC_BLOCK + 109,
}
_SPEAKERS = {"chelsie": _CODEC_BLOCK + 253, "ethan": _CODEC_BLOCK + 254, "aiden": _CODEC_BLOCK + 255}

# Images: patch 16, merge 2 (one merged token per 32x32 pixels), at most 768 merged tokens (1024x768).
_MERGED_PIXELS = 32 * 32
_MIN_PIXELS = 4 * _MERGED_PIXELS
_MAX_PIXELS = 768 * _MERGED_PIXELS


@dataclass(frozen=True)
class DemoSize:
    """The dimensions of a demo checkpoint's Thinker text model (its encoders, Talker and Code2Wav
    are the same in every size)."""

    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    mrope_section: tuple[int, int, int]  # sums to head_dim / 2
    intermediate: int
    moe_intermediate: int
    experts: int
    top_k: int
    init_std: float
    dtype: torch.dtype = torch.float32  # of the saved weights
    shard_bytes: int | None = None  # the weights in files of at most this size; None: transformers' default


DEMO = DemoSize("demo", hidden=64, heads=4, kv_heads=2, head_dim=32, mrope_section=(6, 5, 5), intermediate=128,
                moe_intermediate=32, experts=4, top_k=2, init_std=_INIT_STD)
# Rows of 256 inputs, so int4 experts are quantized in the full-size model's groups of 128 (the
# demo's are 64 and 32 wide). Weights of half the demo's spread give logits of about the demo's spread.
WIDE = DemoSize("wide", hidden=256, heads=4, kv_heads=2, head_dim=64, mrope_section=(12, 10, 10), intermediate=512,
                moe_intermediate=256, experts=8, top_k=2, init_std=_INIT_STD / 2)
# Several GB in bfloat16, in shards of 512 MiB: each layer's 128 experts of the full-size model's
# width (768) on rows of 1,024, for measuring a load's host memory (bench.load_memory) offline.
LOAD_TEST = DemoSize("load-test", hidden=1024, heads=8, kv_heads=2, head_dim=128, mrope_section=(24, 20, 20),
                     intermediate=2048, moe_intermediate=768, experts=128, top_k=8, init_std=_INIT_STD / 4,
                     dtype=torch.bfloat16, shard_bytes=512 << 20)


def ensure_demo_checkpoint(path: Path, size: DemoSize = DEMO) -> Path:
    """The demo checkpoint of `size` in `path`, built there first unless a complete one of this
    version and size is there."""
    path = Path(path)
    if _is_current(path, size):
        return path
    try:
        _check_replaceable(path)
        make_folders(path.parent)  # only what it creates is made private: the parent may be a shared folder
        _build(path, size)
    except (OSError, SafetensorError) as error:  # safetensors reports a full disk as its own error
        reason = (error.strerror if isinstance(error, OSError) else None) or str(error)
        raise CheckpointError(f"cannot write the demo model to '{path}': {reason}") from None
    return path


def _build(path: Path, size: DemoSize) -> None:
    # Built beside the target and renamed into place, so a crash never leaves half a checkpoint.
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        _write_checkpoint(staging, size)
        if _is_current(path, size):  # another process finished first
            return
        if path.exists():
            shutil.rmtree(path)
        os.replace(staging, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _check_replaceable(path: Path) -> None:
    """A folder that is there already is replaced only if it is a demo of another version, or empty:
    `demo_dir` pointed at a folder of the user's own must never delete it."""
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"demo_dir '{path}' is a file: choose a new or empty folder")
    if path.is_dir() and not (path / MARKER_FILE).exists() and any(path.iterdir()):
        raise CheckpointError(f"demo_dir '{path}' holds files that are not a demo model: "
                              "choose a new or empty folder")


def _is_current(path: Path, size: DemoSize) -> bool:
    try:
        marker = json.loads((path / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    # Markers from before there were sizes name none: those are the demo's.
    return marker.get("builder_version") == BUILDER_VERSION and marker.get("size", DEMO.name) == size.name


def _write_checkpoint(folder: Path, size: DemoSize) -> None:
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, size).to(size.dtype)
    model.save_pretrained(folder, **({"max_shard_size": size.shard_bytes} if size.shard_bytes else {}))
    tokenizer.save_pretrained(folder)
    _write_processor_files(folder)
    # Written last: its presence means everything else is complete.
    marker = {"builder_version": BUILDER_VERSION, "seed": _SEED, "size": size.name}
    (folder / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")


def build_tokenizer() -> Qwen2Tokenizer:
    """A byte-level BPE in Qwen2's format, trained on `_CORPUS`, with Qwen3-Omni's special tokens."""
    # Qwen2's own normalizer and pre-tokenizer, so the trained merges mean the same after a reload.
    trainer_tokenizer = Tokenizer(models.BPE())
    trainer_tokenizer.normalizer = normalizers.NFC()
    trainer_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    # The corpus runs out of pairs to merge (about 510 tokens) before this cap.
    trainer = trainers.BpeTrainer(
        vocab_size=1024, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    trainer_tokenizer.train_from_iterator(_CORPUS.splitlines(), trainer)
    bpe = json.loads(trainer_tokenizer.to_str())["model"]
    vocab: dict[str, int] = dict(bpe["vocab"])
    for token in _SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=[tuple(pair) for pair in bpe["merges"]],
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        extra_special_tokens=dict(_NAMED_TOKENS),
        model_max_length=65536,
    )
    tokenizer.add_tokens(
        [AddedToken(t, special=t not in _TEXT_MARKUP, normalized=False) for t in _SPECIAL_TOKENS]
    )
    for word in _ROLE_WORDS:
        ids = tokenizer.encode(word, add_special_tokens=False)
        assert len(ids) == 1, f"role word {word!r} must be one token, got {ids}"
    return tokenizer



# The Thinker's and Talker's config fields that name media tokens (the Thinker also has VISION_END).
MEDIA_TOKEN_FIELDS = {
    "audio_token_id": "<|audio_pad|>",
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "audio_start_token_id": "<|audio_start|>",
    "audio_end_token_id": "<|audio_end|>",
}
VISION_END = "<|vision_end|>"


def media_token_ids(tokenizer: Qwen2Tokenizer) -> dict[str, int]:
    """MEDIA_TOKEN_FIELDS with the tokenizer's ids: what a config needs to match this tokenizer."""
    return {field: tokenizer.convert_tokens_to_ids(token) for field, token in MEDIA_TOKEN_FIELDS.items()}


def build_config(tokenizer: Qwen2Tokenizer, size: DemoSize = DEMO) -> Qwen3OmniMoeConfig:
    """Qwen3-Omni's full configuration at toy size (the Thinker's text model at `size`), every token
    id taken from `tokenizer`."""
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in _SPECIAL_TOKENS}
    role = {word: tokenizer.convert_tokens_to_ids(word) for word in _ROLE_WORDS}
    # No padding rows past the tokenizer (the real model has some): every generated id decodes.
    vocab_size = len(tokenizer)
    thinker_hidden, accept_layer = size.hidden, 2
    media_ids = {
        **media_token_ids(tokenizer),
        "position_id_per_seconds": 13,
        "seconds_per_chunk": 2,
    }
    # M-RoPE sections (t, h, w) sum to head_dim / 2.
    rope = {"rope_type": "default", "rope_theta": 1000000, "mrope_section": list(size.mrope_section),
            "interleaved": True}
    thinker = {
        **media_ids,
        "vision_end_token_id": tokenizer.convert_tokens_to_ids(VISION_END),
        "user_token_id": role["user"],
        "initializer_range": size.init_std,
        "text_config": {
            "vocab_size": vocab_size, "hidden_size": thinker_hidden, "num_hidden_layers": 4,
            "num_attention_heads": size.heads, "num_key_value_heads": size.kv_heads, "head_dim": size.head_dim,
            "intermediate_size": size.intermediate, "moe_intermediate_size": size.moe_intermediate,
            "num_experts": size.experts, "num_experts_per_tok": size.top_k, "norm_topk_prob": True,
            "shared_expert_intermediate_size": 0, "max_position_embeddings": 65536,
            "rope_parameters": {**rope, "mrope_interleaved": True},
            "initializer_range": size.init_std, "tie_word_embeddings": False,
        },
        "vision_config": {
            "depth": 3, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 16,
            "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": thinker_hidden,
            "num_position_embeddings": 256, "deepstack_visual_indexes": [0, 1, 2],
            "initializer_range": _INIT_STD,
        },
        "audio_config": {
            "num_mel_bins": 128, "encoder_layers": 2, "encoder_attention_heads": 2, "encoder_ffn_dim": 64,
            "d_model": 32, "downsample_hidden_size": 16, "output_dim": thinker_hidden, "n_window": 50,
            "n_window_infer": 800, "max_source_positions": 1500, "initializer_range": _INIT_STD,
        },
    }
    talker_hidden = 32
    talker = {
        **media_ids,
        **_CODEC_IDS,
        "speaker_id": dict(_SPEAKERS),
        "num_code_groups": 4,
        "thinker_hidden_size": thinker_hidden,
        "accept_hidden_layer": accept_layer,
        "spatial_merge_size": 2,
        "initializer_range": _INIT_STD,
        "text_config": {
            "vocab_size": _TALKER_VOCAB, "hidden_size": talker_hidden, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 64,
            "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "num_experts": 4,
            "num_experts_per_tok": 2, "norm_topk_prob": True, "max_position_embeddings": 65536,
            "rope_parameters": {**rope, "mrope_section": [4, 2, 2]}, "initializer_range": _INIT_STD,
        },
        "code_predictor_config": {
            "vocab_size": _CODEBOOK_SIZE, "hidden_size": talker_hidden, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 64,
            "num_code_groups": 4, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000},
            "initializer_range": _INIT_STD,
        },
    }
    code2wav = {
        "codebook_size": _CODEBOOK_SIZE, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 2, "intermediate_size": 64, "num_quantizers": 4, "decoder_dim": 32,
        "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2], "sliding_window": 72,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000},
        # Smaller: at _INIT_STD the waveform clips at +-1 throughout (a roar); this is a soft hiss.
        "initializer_range": 0.1,
    }
    return Qwen3OmniMoeConfig(
        thinker_config=thinker,
        talker_config=talker,
        code2wav_config=code2wav,
        enable_audio_output=True,
        im_start_token_id=ids["<|im_start|>"],
        im_end_token_id=ids["<|im_end|>"],
        tts_pad_token_id=ids["<tts_pad>"],
        tts_bos_token_id=ids["<tts_text_bos>"],
        tts_eos_token_id=ids["<tts_text_eod>"],
        system_token_id=role["system"],
        user_token_id=role["user"],
        assistant_token_id=role["assistant"],
        initializer_range=_INIT_STD,
    )


def build_model(tokenizer: Qwen2Tokenizer, size: DemoSize = DEMO) -> Qwen3OmniMoeForConditionalGeneration:
    config = build_config(tokenizer, size)
    torch.manual_seed(_SEED)
    model = Qwen3OmniMoeForConditionalGeneration._from_config(config, dtype=torch.float32)
    init_talker_experts(model, _INIT_STD)
    _center_audio_filters(model)
    end_of_turn = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    model.generation_config = GenerationConfig(
        eos_token_id=end_of_turn, pad_token_id=tokenizer.pad_token_id, do_sample=False
    )
    return model.eval()


def _center_audio_filters(model: Qwen3OmniMoeForConditionalGeneration) -> None:
    # GELU outputs are positive on average, so random filters after it add an offset shared by every
    # frame that drowns the sound itself (every clip then gets the same reply); zero-mean filters
    # pass only what varies.
    tower = model.thinker.model.audio_tower
    with torch.no_grad():
        for layer in (tower.conv2d2, tower.conv2d3, tower.conv_out):
            weight = layer.weight
            weight -= weight.mean(dim=tuple(range(1, weight.dim())), keepdim=True)


def _write_processor_files(folder: Path) -> None:
    """The processor's files as `Qwen3OmniMoeProcessor.save_pretrained` lays them out.

    Written by hand because that method needs a video processor object, which needs torchvision;
    the video section below is what `Qwen2VLVideoProcessor` reads, so a host that has torchvision
    loads the full processor from these files unchanged.
    """
    size = {"shortest_edge": _MIN_PIXELS, "longest_edge": _MAX_PIXELS}
    image_processor = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2, size=size)
    feature_extractor = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, chunk_length=300)
    video_processor = {
        "video_processor_type": "Qwen2VLVideoProcessor",
        "patch_size": 16,
        "merge_size": 2,
        "temporal_patch_size": 2,
        "size": {"shortest_edge": 128 * _MERGED_PIXELS, "longest_edge": 768 * _MERGED_PIXELS},
        "image_mean": image_processor.image_mean,
        "image_std": image_processor.image_std,
        # qwen-vl-utils' per-frame pixel cap, which transformers 5.24 warns it will make the default.
        "cap_pixels_per_frame": True,
    }
    processor_config = {
        "feature_extractor": feature_extractor.to_dict(),
        "image_processor": image_processor.to_dict(),
        "processor_class": "Qwen3OmniMoeProcessor",
        "video_processor": video_processor,
    }
    text = json.dumps(processor_config, indent=2, sort_keys=True) + "\n"
    (folder / "processor_config.json").write_text(text, encoding="utf-8")
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
