"""Load a Qwen3-Omni checkpoint (or the built-in demo) as transformers' own model and processor.

Quantized weights come two ways. A full-precision checkpoint is quantized as it loads, as the
`weights` setting says (model/quantized/), and the quantized layers are kept on disk for the next
start (stored.py). A checkpoint quantized before (compressed-tensors: the community's 4-bit and FP8
Qwen3-Omni checkpoints; or GPTQ-packed int4, as AutoRound exports them; its config.json has a
`quantization_config`) loads in its own format, as it is: the `weights` setting may stay 'bf16'
(the default, "as the checkpoint holds them") or name the checkpoint's format ('int4' for W4A16 and
GPTQ, 'fp8' for FP8); another value is refused, as quantizing a quantized checkpoint again would
round its weights twice and an int4 checkpoint cannot become fp8.
Such a checkpoint needs no store: its layers are read as they are stored, and nothing else is
quantized (its embeddings, lm_head and encoders stay as it holds them, where our int4 keeps them in
int8). The start-up line says which weights run ("int4 weights, as the checkpoint holds them").
"""

import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration, Qwen3OmniMoeProcessor
from transformers.utils import is_flash_attn_2_available

from omni_local.kernels.triton_support import refuse_without_fp8
from omni_local.errors import CheckpointError, SettingsError
from omni_local.model.demo import ensure_demo_checkpoint
from omni_local.model.host_experts import AUTO, keep_in_host_memory
from omni_local.model.quantized import quantize_layers
from omni_local.model.quantized.prequantized import CheckpointQuantization, read_quantization_config
from omni_local.model.quantized.stored import StoredLayers, filled_from_disk
from omni_local.model.reasoning import template_opens_reasoning
from omni_local.model.weights import load_weights, weight_files
from omni_local.model.workarounds import apply_workarounds, load_processor
from omni_local.protocol.kinds import ModelKind
from omni_local.protocol.tools import CALL_OPEN
from omni_local.settings import EngineConfig
from omni_local.start_up_steps import start_up_step

log = logging.getLogger(__name__)

_END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LoadedModel:
    model: Qwen3OmniMoeForConditionalGeneration  # .thinker always; .talker and .code2wav only with speech
    processor: Qwen3OmniMoeProcessor
    path: Path  # the checkpoint directory
    device: torch.device
    dtype: torch.dtype
    kind: ModelKind = "instruct"  # which member of the Qwen3-Omni family
    quantized: str = ""  # which weights are quantized, for the start-up line ("" for none)

    @property
    def speech(self) -> bool:
        return bool(self.model.has_talker)


def load_model(settings: EngineConfig, before_loading: Callable[[torch.nn.Module], None] | None = None) -> LoadedModel:
    """The checkpoint (or the demo) as `settings` ask. `before_loading` is shown the empty model,
    full precision with its parameters on the meta device, before any weight is read (the memory
    plan); it may raise to stop, and mark experts to be held in host memory (model/host_experts.py)."""
    path = ensure_demo_checkpoint(settings.demo_path) if settings.model == "demo" else Path(settings.model)
    path = path.expanduser().resolve()
    check_checkpoint(path)
    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    _check_attention(settings.attn_implementation)

    config, talker, quantization = _read_config(path)
    if settings.speech and not talker:
        raise CheckpointError(f"checkpoint '{path}' has no Talker (enable_audio_output is false): set speech = false")
    try:
        processor = load_processor(path)
    except (OSError, ValueError, TypeError, KeyError) as error:
        raise CheckpointError(f"could not load the processor files in '{path}': {error}") from None
    kind = recognise_kind(settings.model_kind, talker, processor, path)
    # Without speech the Talker and Code2Wav are never built, so their weights are skipped on load.
    config.enable_audio_output = settings.speech
    if quantization is not None:
        formats = _checkpoint_formats(path, quantization, settings.weights)
        _check_weights(formats, True, settings, device)
        prepare = partial(_placed, settings=settings, before_loading=before_loading)
        model = load_weights(path, config, dtype, device, settings.attn_implementation, prepare=prepare,
                             quantization=quantization)
        quantized = f"{' and '.join(formats)} weights, as the checkpoint holds them"
        log.info("checkpoint '%s' is quantized (%s): %s", path, quantization.method, quantized)
    else:
        formats = [] if settings.weights == "bf16" else [settings.weights]
        _check_weights(formats, False, settings, device)
        prepare = partial(_prepare, settings=settings, path=path, dtype=dtype, device=device,
                          before_loading=before_loading)
        model = load_weights(path, config, dtype, device, settings.attn_implementation, prepare=prepare)
        if formats and not filled_from_disk(model):
            with start_up_step("the quantized layers' store written"):
                _stored_layers(settings, path, dtype).save(model)
        quantized = f"{settings.weights} weights" if formats else ""
    model.eval()
    apply_workarounds(model, end_of_turn_ids(processor), processor.tokenizer.pad_token_id)
    return LoadedModel(model=model, processor=processor, path=path, device=device, dtype=dtype, kind=kind,
                       quantized=quantized)


def recognise_kind(setting: str, talker: bool, processor: Qwen3OmniMoeProcessor, path: Path) -> ModelKind:
    """Which member of the family a checkpoint is: the `model_kind` setting's, unless 'auto'. Only
    Instruct has a Talker; of the two without, Thinking's chat template opens a reasoning block.
    The Captioner's files are what Instruct exported without its Talker holds (it is Instruct
    fine-tuned, with Instruct's template), so only its name tells it: one that is not named so is
    taken for Instruct without speech, which answers typed text."""
    if setting != "auto":
        return setting
    if talker:
        return "instruct"
    if template_opens_reasoning(processor):
        return "thinking"
    return "captioner" if _named_captioner(path) else "instruct"


def _named_captioner(path: Path) -> bool:
    """Whether the checkpoint's folder is named for the Captioner (Qwen's "Qwen3-Omni-30B-A3B-Captioner",
    or a name made from it); in the Hugging Face cache, .../models--Qwen--<name>/snapshots/<commit>."""
    names = [path.name]
    if path.parent.name == "snapshots":
        names.append(path.parent.parent.name)
    return any("captioner" in name.lower() for name in names)


def quiet_library_logs() -> None:
    """For the CLI and the UI: transformers' load-time notes and progress bars are not for users."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def media_markup_token_ids(loaded: LoadedModel) -> list[int]:
    """Tokens that only the processor may place (media placeholders and their brackets)."""
    tokenizer = loaded.processor.tokenizer
    names = ("image_token", "video_token", "audio_token", "vision_bos_token", "vision_eos_token",
             "audio_bos_token", "audio_eos_token")
    return sorted({tokenizer.convert_tokens_to_ids(getattr(tokenizer, name)) for name in names})


def call_open_token_id(loaded: LoadedModel) -> int | None:
    """The token that opens a tool call (`<tool_call>`, one added token in Qwen3-Omni's tokenizer), or
    None where the tokenizer spells it in several."""
    ids = loaded.processor.tokenizer.encode(CALL_OPEN, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def thinker_eos_token_ids(loaded: LoadedModel) -> list[int]:
    return end_of_turn_ids(loaded.processor)


def end_of_turn_ids(processor: Qwen3OmniMoeProcessor) -> list[int]:
    """The ids that end a Thinker reply: end of turn, then end of text."""
    return _token_ids(processor, _END_OF_TURN_TOKENS)


def check_checkpoint(path: Path) -> None:
    """Raise `CheckpointError` naming every file `path` lacks to be a loadable Qwen3-Omni checkpoint."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory '{path}' does not exist")
    missing = [
        *(["config.json"] if not (path / "config.json").is_file() else []),
        *_missing_weights(path),
        *_missing_tokenizer(path),
        *_missing_processor_config(path),
        *_missing_chat_template(path),
    ]
    if missing:
        raise CheckpointError(f"checkpoint '{path}' is incomplete: missing " + "; ".join(missing))


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    match = re.fullmatch(r"cuda(?::(\d+))?", name)
    if match is None:
        raise SettingsError(f"setting 'device' must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {name!r}")
    if not torch.cuda.is_available():
        raise SettingsError(f"setting 'device' is {name!r}, but no CUDA GPU is visible")
    index = int(match.group(1) or 0)
    if index >= torch.cuda.device_count():
        raise SettingsError(f"setting 'device' is {name!r}, but only {torch.cuda.device_count()} GPU(s) are visible")
    return torch.device("cuda", index)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def _prepare(model: torch.nn.Module, settings: EngineConfig, path: Path, dtype: torch.dtype, device: torch.device,
             before_loading: Callable[[torch.nn.Module], None] | None) -> None:
    """The empty model made ready for the loader: shown to `before_loading`, then quantized layers in
    the places `settings.weights` quantizes, read back from disk where they were kept, else
    quantizing each tensor on the device as the loader reads it (no full-precision copy of the
    model is ever made)."""
    _placed(model, settings, before_loading)
    quantize_layers(model, settings.weights)  # the quantized experts keep their place (host_experts.carry_mark)
    if settings.weights != "bf16":
        with start_up_step("the quantized layers' store looked up (the checkpoint's fingerprint) and read"):
            _stored_layers(settings, path, dtype).fill(model, device)


def _placed(model: torch.nn.Module, settings: EngineConfig,
            before_loading: Callable[[torch.nn.Module], None] | None) -> None:
    """The empty model shown to `before_loading` (the memory plan, which marks the experts it puts in
    host memory), and the experts `experts_on_gpu` = N puts there marked so (model/host_experts.py)."""
    if before_loading is not None:
        before_loading(model)
    if settings.experts_on_gpu != AUTO:
        keep_in_host_memory(model, settings.experts_on_gpu, embeddings=False)


def _stored_layers(settings: EngineConfig, path: Path, dtype: torch.dtype) -> StoredLayers:
    return StoredLayers.at(settings.cache_path, weight_files(path), settings.weights, dtype)


def _checkpoint_formats(path: Path, quantization: CheckpointQuantization, weights: str) -> list[str]:
    """The formats a pre-quantized checkpoint holds, refusing a `weights` setting that names another."""
    formats = sorted(quantization.formats)
    if weights not in ("bf16", *formats):
        allowed = " or ".join(repr(f) for f in ("bf16", *formats))
        raise SettingsError(f"checkpoint '{path}' is already quantized ({' and '.join(formats)}, "
                            f"{quantization.method}) and loads as it is: setting 'weights' must be {allowed}, "
                            f"not {weights!r}")
    return formats


def _check_weights(formats: list[str], prequantized: bool, settings: EngineConfig, device: torch.device) -> None:
    """Refuse quantized weights (of `formats`: the `weights` setting's, or a pre-quantized
    checkpoint's) where they cannot run, saying what would."""
    if not formats or device.type != "cuda":
        return
    source = "the checkpoint holds {} weights" if prequantized else "setting 'weights' is '{}'"
    if "fp8" in formats:
        refuse_without_fp8(source.format("fp8"), "an int4 checkpoint runs here, or a bf16 one with weights = 'int4'"
                           if prequantized else "use weights = 'int4'", device)
    if settings.moe_backend == "torch":
        raise SettingsError(f"{source.format(formats[0])}: on a GPU its experts run in our kernels, so setting "
                            "'moe_backend' must be 'triton' or 'auto', not 'torch'")


def _check_attention(name: str) -> None:
    if name == "flash_attention_2" and not is_flash_attn_2_available():
        raise SettingsError("setting 'attn_implementation' is 'flash_attention_2', but flash-attn is not installed")


def _read_config(path: Path) -> tuple[Qwen3OmniMoeConfig, bool, CheckpointQuantization | None]:
    """The checkpoint's config, whether it has a Talker, and its quantization if it was quantized
    before loading (compressed-tensors, or GPTQ-packed int4)."""
    config_file = path / "config.json"
    try:
        written = json.loads(config_file.read_text(encoding="utf-8"))
        model_type = written.get("model_type")
        if model_type != Qwen3OmniMoeConfig.model_type:
            raise CheckpointError(f"'{config_file}' describes a {model_type!r} model, not Qwen3-Omni (qwen3_omni_moe)")
        config = Qwen3OmniMoeConfig.from_pretrained(path)
    except (OSError, ValueError, TypeError, AttributeError) as error:
        raise CheckpointError(f"could not read '{config_file}': {error}") from None
    try:
        quantization = read_quantization_config(written)
    except CheckpointError as error:
        raise CheckpointError(f"checkpoint '{path}': {error}") from None
    except (AttributeError, TypeError, KeyError) as error:
        raise CheckpointError(f"checkpoint '{path}': its quantization_config cannot be read ({error!r})") from None
    # The config class fills in a default Talker where the file names none (Thinking's and the
    # Captioner's do not), so the file says whether there is one.
    return config, bool(config.enable_audio_output) and "talker_config" in written, quantization


def _missing_weights(path: Path) -> list[str]:
    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        try:
            shards = sorted(set(json.loads(index_file.read_text(encoding="utf-8"))["weight_map"].values()))
        except (ValueError, KeyError, AttributeError):
            return [f"a readable weight_map in {index_file.name}"]
        absent = [shard for shard in shards if not (path / shard).is_file()]
        return [f"weight shard {shard} (named in {index_file.name})" for shard in absent]
    if (path / "model.safetensors").is_file():
        return []
    return ["weights (model.safetensors, or model.safetensors.index.json and its shards)"]


def _missing_tokenizer(path: Path) -> list[str]:
    missing = [] if (path / "tokenizer_config.json").is_file() else ["tokenizer_config.json"]
    has_vocab = (path / "tokenizer.json").is_file() or all((path / f).is_file() for f in ("vocab.json", "merges.txt"))
    return missing + ([] if has_vocab else ["tokenizer vocabulary (tokenizer.json, or vocab.json and merges.txt)"])


def _missing_processor_config(path: Path) -> list[str]:
    if any((path / f).is_file() for f in ("processor_config.json", "preprocessor_config.json")):
        return []
    return ["processor settings (processor_config.json or preprocessor_config.json)"]


def _missing_chat_template(path: Path) -> list[str]:
    if any((path / f).is_file() for f in ("chat_template.jinja", "chat_template.json")):
        return []
    for name in ("processor_config.json", "tokenizer_config.json"):
        try:
            if "chat_template" in json.loads((path / name).read_text(encoding="utf-8")):
                return []
        except (OSError, ValueError):
            continue
    return ["chat template (chat_template.jinja or chat_template.json)"]


def _token_ids(processor: Qwen3OmniMoeProcessor, tokens: tuple[str, ...]) -> list[int]:
    vocab = processor.tokenizer.get_vocab()
    return [vocab[token] for token in tokens if token in vocab]
