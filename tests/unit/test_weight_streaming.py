"""The loader builds the model on the meta device and streams the checkpoint's tensors into it: the
result is `from_pretrained`'s model bit for bit, a quantizer's modules are handed their tensors,
and a checkpoint that does not fit the model is refused, naming what does not fit."""

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

from checkpoint_layouts import write_older_layout
from omni_local.errors import CheckpointError
from omni_local.model import load_model
from omni_local.model.quantized import quantize_layers, weights_bytes
from omni_local.model.weights import load_weights
from omni_local.settings import Settings


def _without_generation_config(demo: Path, target: Path) -> Path:
    shutil.copytree(demo, target)
    (target / "generation_config.json").unlink()
    return target


def _with_tied_embeddings(demo: Path, target: Path) -> Path:
    """The demo with the Thinker's output matrix tied to its embeddings, as the files then hold it: once."""
    shutil.copytree(demo, target)
    config = json.loads((target / "config.json").read_text(encoding="utf-8"))
    config["thinker_config"]["tie_word_embeddings"] = True
    (target / "config.json").write_text(json.dumps(config), encoding="utf-8")
    _edit_weights(target, lambda weights: weights.pop("thinker.lm_head.weight"))
    return target


def _edit_weights(path: Path, edit: Callable[[dict[str, torch.Tensor]], object]) -> None:
    weights = load_file(path / "model.safetensors")
    edit(weights)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})


# name -> (how the checkpoint is written from the demo, speech, dtype)
CHECKPOINTS = {
    "demo, speech on": (lambda demo, target: demo, True, "float32"),
    "demo, speech off": (lambda demo, target: demo, False, "float32"),
    "demo in bfloat16, speech on": (lambda demo, target: demo, True, "bfloat16"),
    "older layout in 15 shards, speech on": (write_older_layout, True, "float32"),
    "demo without generation_config.json": (_without_generation_config, False, "float32"),
    "demo with tied Thinker embeddings": (_with_tied_embeddings, False, "float32"),
}


def _from_pretrained(path: Path, speech: bool, dtype: torch.dtype) -> Qwen3OmniMoeForConditionalGeneration:
    config = Qwen3OmniMoeConfig.from_pretrained(path)
    config.enable_audio_output = speech
    return Qwen3OmniMoeForConditionalGeneration.from_pretrained(path, config=config, dtype=dtype)


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (the non-persistent ones too), on the host."""
    return {name: tensor.cpu() for name, tensor in [*model.state_dict().items(), *model.named_buffers()]}


@pytest.mark.parametrize("case", CHECKPOINTS)
def test_the_streamed_model_is_from_pretrained_s_bit_for_bit(case, demo_settings, demo_checkpoint, tmp_path):
    write, speech, dtype = CHECKPOINTS[case]
    path = write(demo_checkpoint, tmp_path / "checkpoint")
    loaded = load_model(demo_settings.replace(model=str(path), speech=speech, dtype=dtype))
    reference = _from_pretrained(path, speech, loaded.dtype)
    streamed, expected = _tensors(loaded.model), _tensors(reference)
    assert streamed.keys() == expected.keys()
    differing = [name for name in expected
                 if streamed[name].dtype != expected[name].dtype or not torch.equal(streamed[name], expected[name])]
    assert differing == []
    assert loaded.model.generation_config.to_dict() == reference.generation_config.to_dict()
    assert loaded.model.has_talker == speech


@pytest.mark.parametrize("weights", ["bf16", "int4"])
def test_tied_embeddings_stay_one_full_precision_tensor_and_are_planned_so(weights, demo_settings, demo_checkpoint,
                                                                           tmp_path):
    path = _with_tied_embeddings(demo_checkpoint, tmp_path / "tied")
    settings = demo_settings.replace(model=str(path), weights=weights, cache_dir=str(tmp_path / "cache"))
    model = load_model(settings).model
    thinker = model.thinker
    assert thinker.lm_head.weight is thinker.model.language_model.embed_tokens.weight
    held = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    assert weights_bytes(load_model(settings.replace(weights="bf16")).model, weights, speech=False) == held


def test_int4_streamed_in_holds_what_quantizing_the_loaded_full_precision_model_gives(demo_settings, tmp_path):
    settings = demo_settings.replace(speech=True, cache_dir=str(tmp_path / "cache"))
    streamed = load_model(settings.replace(weights="int4")).model  # each tensor quantized as it is read
    whole = load_model(settings).model
    quantize_layers(whole, "int4")  # as the random-weights bench does

    theirs = _tensors(whole)
    assert {name: t.dtype for name, t in _tensors(streamed).items()} == {name: t.dtype for name, t in theirs.items()}
    assert all(torch.equal(tensor, theirs[name]) for name, tensor in _tensors(streamed).items())


# The quantization hook


class TakesWeights(torch.nn.Module):
    """Stands in for a quantized linear layer: keeps the tensors it is handed."""

    def __init__(self) -> None:
        super().__init__()
        self.taken: dict[str, torch.Tensor] = {}

    def take_weight(self, name: str, tensor: torch.Tensor) -> None:
        self.taken[name] = tensor


class TakesExpertWeights(torch.nn.Module):
    """Stands in for quantized routed experts: keeps each expert's matrices it is handed."""

    def __init__(self) -> None:
        super().__init__()
        self.taken: dict[tuple[int, str], torch.Tensor] = {}

    def take_expert_weight(self, expert: int, projection: str, tensor: torch.Tensor) -> None:
        self.taken[expert, projection] = tensor


def _config(path: Path, speech: bool) -> Qwen3OmniMoeConfig:
    config = Qwen3OmniMoeConfig.from_pretrained(path)
    config.enable_audio_output = speech
    return config


def test_prepare_sees_the_empty_model_and_swapped_modules_are_handed_their_tensors_in_the_model_dtype(
    demo_checkpoint,
):
    seen_on_meta = []

    def prepare(model: torch.nn.Module) -> None:
        seen_on_meta.append(all(p.is_meta for p in model.parameters()))
        model.thinker.lm_head = TakesWeights()
        model.thinker.model.language_model.layers[1].mlp.experts = TakesExpertWeights()
        model.talker.model.layers[0].mlp.experts = TakesExpertWeights()

    model = load_weights(demo_checkpoint, _config(demo_checkpoint, speech=True), torch.bfloat16,
                         torch.device("cpu"), "sdpa", prepare=prepare)
    assert seen_on_meta == [True]
    in_files = load_file(demo_checkpoint / "model.safetensors")
    files = {name: tensor.to(torch.bfloat16) for name, tensor in in_files.items()}
    assert model.thinker.lm_head.taken.keys() == {"weight"}
    assert torch.equal(model.thinker.lm_head.taken["weight"], files["thinker.lm_head.weight"])
    for experts, prefix in ((model.thinker.model.language_model.layers[1].mlp.experts, "thinker.model.layers.1"),
                            (model.talker.model.layers[0].mlp.experts, "talker.model.layers.0")):
        expected = {(e, projection): files[f"{prefix}.mlp.experts.{e}.{projection}.weight"]
                    for e in range(4) for projection in ("gate_proj", "up_proj", "down_proj")}
        assert experts.taken.keys() == expected.keys()
        assert all(torch.equal(experts.taken[key], expected[key]) for key in expected)
    # The Talker's shared expert is a plain MLP, loaded as any other.
    shared = model.talker.model.layers[0].mlp.shared_expert.gate_proj.weight
    assert torch.equal(shared, files["talker.model.layers.0.mlp.shared_expert.gate_proj.weight"])


def test_a_tensor_left_on_the_meta_device_after_loading_is_an_error_naming_it(demo_checkpoint):
    def prepare(model: torch.nn.Module) -> None:
        model.thinker.lm_head.register_parameter("scales", torch.nn.Parameter(torch.empty(4, device="meta")))

    with pytest.raises(RuntimeError, match=re.escape("still on the meta device after loading: thinker.lm_head.scales")):
        load_weights(demo_checkpoint, _config(demo_checkpoint, speech=False), torch.float32, torch.device("cpu"),
                     "sdpa", prepare=prepare)


# Checkpoints that do not fit


def _drop_one_expert(weights: dict[str, torch.Tensor]) -> None:
    del weights["thinker.model.layers.1.mlp.experts.2.up_proj.weight"]


def _add_a_stranger(weights: dict[str, torch.Tensor]) -> None:
    weights["thinker.model.layers.0.mlp.spare.weight"] = torch.zeros(2, 2)


def _reshape_an_expert(weights: dict[str, torch.Tensor]) -> None:
    name = "thinker.model.layers.0.mlp.experts.3.down_proj.weight"
    weights[name] = weights[name].t().contiguous()


NOT_FITTING = {
    "an expert's matrix missing": (_drop_one_expert, True, "lacks 1 weight(s): "
                                   "thinker.model.language_model.layers.1.mlp.experts.2.up_proj.weight"),
    "a weight the model has no place for": (_add_a_stranger, False,
                                            "holds 1 weight(s) this model has no place for: "
                                            "thinker.model.layers.0.mlp.spare.weight"),
    "an expert's matrix of another shape": (_reshape_an_expert, False,
                                            "holds thinker.model.layers.0.mlp.experts.3.down_proj.weight as (32, 64), "
                                            "but the model expects (64, 32)"),
}


@pytest.mark.parametrize("case", NOT_FITTING)
def test_a_checkpoint_that_does_not_fit_the_model_is_refused_naming_what_does_not(
    case, demo_settings: Settings, demo_checkpoint, tmp_path
):
    edit, speech, phrase = NOT_FITTING[case]
    path = shutil.copytree(demo_checkpoint, tmp_path / "edited")
    _edit_weights(path, edit)
    with pytest.raises(CheckpointError) as raised:
        load_model(demo_settings.replace(model=str(path), speech=speech))
    assert phrase in str(raised.value) and str(path.resolve()) in str(raised.value)


def test_without_speech_the_talker_and_code2wav_weights_in_the_files_are_skipped(demo_model, demo_checkpoint):
    in_files = load_file(demo_checkpoint / "model.safetensors").keys()
    assert any(name.startswith(("talker.", "code2wav.")) for name in in_files)
    assert not any(name.startswith(("talker.", "code2wav.")) for name in demo_model.model.state_dict())


def test_a_corrupt_shard_is_refused_naming_it(demo_settings, demo_checkpoint, tmp_path):
    path = write_older_layout(demo_checkpoint, tmp_path / "older", shards=3)
    (path / "model-00002-of-00003.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match=r"could not load the weights in '.*model-00002-of-00003\.safetensors'"):
        load_model(demo_settings.replace(model=str(path)))
