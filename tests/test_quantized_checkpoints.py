"""A checkpoint quantized before loading, as compressed-tensors 0.20 writes the community's 4-bit
(W4A16) and FP8 Qwen3-Omni checkpoints (compressed_checkpoints.py writes the demo so, with that
package's own code): it loads in its own format with no full-precision step, holds the very bytes
compressed-tensors packed, and answers as transformers' `generate` does on the loaded model; a
quantization it cannot load is refused at start-up, naming the part."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors import FloatQuantizationCompressor, PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, preset_name_to_scheme
from safetensors.torch import load_file, save_file

from compressed_checkpoints import IGNORE, SCHEMES, write_compressed, write_quantization_config
from conftest import TEST_DEVICE
from moe_cases import ROUTES, logits_choosing
from replies import media, reference_tokens, send, transformers_speech
from samples import clip, picture
from omni_local.api import OmniLocal
from omni_local.api.messages import Message
from omni_local.errors import CheckpointError, SettingsError
from omni_local.model import load_model
from omni_local.model.checkpoint_names import expert_slice, fused_rows, model_name
from omni_local.model.quantized import QuantizedExperts, QuantizedLinear, Quantized, dequantize
from omni_local.model.quantized import experts as experts_module
from omni_local.model.quantized import linear as linear_module

FORMATS = {"W4A16": "int4", "FP8": "fp8"}
SHARDS = {"W4A16": 3, "FP8": 1}  # the 4-bit one in three files, a layer's tensors spread over them


@pytest.fixture(scope="module")
def compressed(demo_checkpoint, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("compressed")
    return {scheme: write_compressed(demo_checkpoint, root / scheme, scheme, SHARDS[scheme]) for scheme in SCHEMES}


@pytest.fixture(scope="module", params=list(SCHEMES))
def compressed_app(request, demo_settings, compressed):
    settings = demo_settings.replace(model=str(compressed[request.param]), speech=True, max_speech_seconds=1.0)
    with OmniLocal(settings) as app:
        yield app


def stored_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor in the checkpoint's files, and the file each is in."""
    tensors, files = {}, {}
    for file in sorted(path.glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            tensors[name], files[name] = tensor, file.name
    return tensors, files


def loaded_weight(model: torch.nn.Module, layer: str) -> Quantized:
    """The quantized weight the model holds for checkpoint layer `layer`: a routed expert's rows of
    its layer's experts, or a dense layer's."""
    weight = model_name(f"{layer}.weight")
    part = expert_slice(weight)
    if part is None:
        return model.get_submodule(weight.removesuffix(".weight")).weight
    experts = model.get_submodule(part.module)
    fused, rows = fused_rows(part.projection, experts.intermediate_dim)
    whole = getattr(experts, fused.removesuffix("_proj"))
    return Quantized(whole.format, whole.values[part.expert, rows], whole.scales[part.expert, rows], whole.group)


def copy_with_config(checkpoint: Path, target: Path, config: QuantizationConfig | dict) -> Path:
    """A copy of `checkpoint` whose config.json holds another quantization_config."""
    shutil.copytree(checkpoint, target)
    if isinstance(config, QuantizationConfig):
        write_quantization_config(target, config)
    else:
        written = json.loads((target / "config.json").read_text(encoding="utf-8"))
        written["quantization_config"] = config
        (target / "config.json").write_text(json.dumps(written), encoding="utf-8")
    return target


# Loading


@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_layer_the_config_covers_is_held_in_the_checkpoints_format_and_nothing_else(
    scheme, demo_settings, compressed
):
    model = load_model(demo_settings.replace(model=str(compressed[scheme]), speech=True)).model
    stored, _ = stored_tensors(compressed[scheme])
    quantized_layers = {name.rpartition(".")[0] for name in stored if name.endswith(".weight_scale")}
    held = {name for name, module in model.named_modules() if isinstance(module, (QuantizedLinear, QuantizedExperts))}
    experts = {layer for layer in quantized_layers if ".mlp.experts." in layer}
    experts_modules = {layer.rpartition(".mlp.experts.")[0] + ".mlp.experts" for layer in experts}
    assert held == {model_name(name) for name in experts_modules | (quantized_layers - experts)}
    assert {model.get_submodule(name).format for name in held} == {FORMATS[scheme]}
    # The attention, experts, shared experts and code predictor of both stacks; not the heads, routers or towers.
    assert "talker.code_predictor.model.layers.0.self_attn.q_proj" in held
    assert "talker.model.layers.0.mlp.shared_expert.down_proj" in held
    assert not any(name.startswith(("thinker.model.visual", "thinker.model.audio_tower", "code2wav")) or
                   name.endswith(("lm_head", "codec_head", ".gate")) for name in held)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_loaded_layers_hold_the_bytes_compressed_tensors_stored_and_dequantize_as_it_does(
    scheme, demo_settings, compressed
):
    path = compressed[scheme]
    model = load_model(demo_settings.replace(model=str(path), speech=True)).model
    stored, files = stored_tensors(path)
    written = QuantizationConfig.model_validate(json.loads((path / "config.json").read_text())["quantization_config"])
    compressor = PackedQuantizationCompressor if scheme == "W4A16" else FloatQuantizationCompressor
    layers = sorted(name.removesuffix(".weight_scale") for name in stored if name.endswith(".weight_scale"))
    assert len(layers) > 100
    for layer in layers:
        parts = {name.rpartition(".")[2]: tensor for name, tensor in stored.items() if name.rpartition(".")[0] == layer}
        ours = loaded_weight(model, layer)
        if scheme == "W4A16":
            assert torch.equal(ours.values, parts["weight_packed"].view(torch.uint8)), layer
            assert torch.equal(ours.scales, parts["weight_scale"]), layer
        else:
            assert torch.equal(ours.values.view(torch.uint8), parts["weight"].view(torch.uint8)), layer
            assert torch.equal(ours.scales, parts["weight_scale"].flatten()), layer
        theirs = compressor.decompress(parts, written.config_groups["group_0"])["weight"]
        assert torch.equal(dequantize(ours, torch.float32), theirs), layer
    if scheme == "W4A16":
        assert any(files[f"{layer}.weight_packed"] != files[f"{layer}.weight_scale"] for layer in layers)


def test_loading_a_quantized_checkpoint_never_makes_a_full_precision_copy_of_a_quantized_layer(
    demo_settings, compressed, monkeypatch
):
    def refused(*args, **kwargs):
        raise AssertionError("a quantized layer was quantized again from full precision")

    monkeypatch.setattr(QuantizedExperts, "take_expert_weight", refused)
    monkeypatch.setattr(experts_module, "quantize", refused)
    monkeypatch.setattr(linear_module, "quantize", refused)
    for scheme, path in compressed.items():
        settings = demo_settings.replace(model=str(path), speech=True, cache_dir=str(path.parent / f"cache-{scheme}"))
        model = load_model(settings).model
        assert not any(".mlp.experts." in name or name.endswith(".self_attn.q_proj.weight")
                       for name, _ in model.named_parameters() if name.startswith("thinker.model.language_model"))
        assert not (Path(settings.cache_dir) / "quantized").exists(), "a quantized checkpoint needs no store"


def test_the_weights_setting_may_name_the_checkpoints_own_format_but_not_another(demo_settings, compressed):
    int4 = load_model(demo_settings.replace(model=str(compressed["W4A16"]), weights="int4"))
    assert int4.quantized == "int4 weights, as the checkpoint holds them"
    with pytest.raises(SettingsError) as raised:
        load_model(demo_settings.replace(model=str(compressed["W4A16"]), weights="fp8"))
    assert ("is already quantized (int4, compressed-tensors) and loads as it is: setting 'weights' must be 'bf16' "
            "or 'int4', not 'fp8'") in str(raised.value)


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the interpreter tests run on the CPU run")
@pytest.mark.parametrize("scheme", SCHEMES)
def test_our_expert_kernels_read_the_checkpoints_experts_as_their_dequantized_weights(
    scheme, demo_settings, compressed
):
    from omni_local.engine.moe.block import renormalizes
    from omni_local.engine.moe.routed_experts import weighted_expert_rows
    from omni_local.engine.moe.tile_configs import GemmTile, TileConfig

    model = load_model(demo_settings.replace(model=str(compressed[scheme]))).model
    mlp = model.thinker.model.language_model.layers[1].mlp
    assert renormalizes(mlp)
    experts = mlp.experts  # W4A16: two groups of 32 inputs a gate/up row, where our own int4 would take one of 64
    logits = logits_choosing(ROUTES["an expert gets no token"], num_experts=experts.num_experts)
    hidden = torch.randn((len(logits), experts.hidden_dim), generator=torch.Generator().manual_seed(5))
    weights, chosen = torch.topk(torch.softmax(logits, dim=-1), mlp.gate.top_k, dim=-1)
    expected = experts(hidden, chosen, weights / weights.sum(-1, keepdim=True))

    tiles = TileConfig(16, GemmTile(16, 32), GemmTile(16, 32))
    rows = weighted_expert_rows(hidden, logits, experts.gate_up_values, experts.down_values, top_k=mlp.gate.top_k,
                                renormalize=renormalizes(mlp), config=tiles, gate_up_scales=experts.gate_up_scales,
                                down_scales=experts.down_scales)

    torch.testing.assert_close(rows.sum(dim=1), expected, rtol=1e-5, atol=1e-5)


# Answers


def test_the_start_up_line_says_the_weights_are_the_checkpoints(compressed_app):
    format = compressed_app.backend.loaded.quantized.split()[0]
    assert compressed_app.info.runs_on == f"float32 on cpu, {format} weights, as the checkpoint holds them"


CASES = {
    "text": lambda: ["Tell me a story about a lighthouse keeper."],
    "image": lambda: [picture(1), "What is in this picture?"],
    "audio": lambda: [clip(2), "What did you hear?"],
}


@pytest.mark.parametrize("case", CASES)
def test_a_written_reply_is_transformers_generate_on_the_loaded_model(compressed_app, case):
    parts = CASES[case]()

    final = compressed_app.session().send(parts[-1], max_new_tokens=24, **media(parts)).result()

    assert final.token_ids == reference_tokens(compressed_app, [Message("user", parts)])
    assert len(final.token_ids) > 8


def test_a_spoken_reply_has_the_codes_of_transformers_generate_on_the_loaded_model(compressed_app):
    parts = ["Sing me a song about the sea."]
    final, frames, _, _ = send(compressed_app, compressed_app.session(), parts[-1], voice="Chelsie")
    text, codes = transformers_speech(compressed_app, [Message("user", parts)], "Chelsie")
    assert final.token_ids == text and len(text) > 8
    assert frames == codes.T.tolist() and final.speech.frames > 0


# What is refused


def _config(scheme, format: str, **fields) -> QuantizationConfig:
    return QuantizationConfig(config_groups={"group_0": scheme}, ignore=IGNORE, format=format,
                              quantization_status="compressed", **fields)


def _preset(name: str):
    return preset_name_to_scheme(name, ["Linear"])


# name -> (the config, a phrase the error must hold)
UNSUPPORTED = {
    "asymmetric int4 (W4A16_ASYM)": (lambda: _config(_preset("W4A16_ASYM"), "pack-quantized"),
                                     "quantization config group_0: asymmetric weights (with zero points) is not "
                                     "supported"),
    "int8 weights and activations (W8A8)": (lambda: _config(_preset("W8A8"), "int-quantized"),
                                            "group_0: int 8-bit weights, int 8-bit input activations are not"),
    "fp8 in blocks (FP8_BLOCK)": (lambda: _config(_preset("FP8_BLOCK"), "float-quantized"),
                                  "group_0: fp8 weights of strategy 'block', fp8 input activations of strategy "
                                  "'group' are not supported"),
    "static fp8 activations (FP8)": (lambda: _config(_preset("FP8"), "float-quantized"),
                                     "fp8 weights of strategy 'tensor', static input activations"),
    "3-bit integers (W3A16)": (lambda: _config(_preset("W3A16"), "pack-quantized"), "group_0: int 3-bit weights"),
    "an unknown format": (lambda: _config(SCHEMES["W4A16"]().model_copy(update={"format": None}), "nibble-packed"),
                          "group_0: format 'nibble-packed' for int4 weights is not supported"),
    "a quantized KV cache": (lambda: _config(SCHEMES["W4A16"](), "pack-quantized", kv_cache_scheme=QuantizationArgs(
        num_bits=8, type="float", strategy="tensor")), "kv_cache_scheme (a quantized KV cache) is not supported"),
    "another quantization method (AWQ)": (lambda: {"quant_method": "awq", "bits": 4, "group_size": 128},
                                          "quant_method 'awq' is not supported"),
}


@pytest.mark.parametrize("case", UNSUPPORTED)
def test_a_quantization_that_does_not_map_onto_our_formats_is_refused_at_start_up_naming_the_part(
    case, demo_settings, compressed, tmp_path
):
    config, phrase = UNSUPPORTED[case]
    path = copy_with_config(compressed["W4A16"], tmp_path / "copy", config())
    with pytest.raises(CheckpointError) as raised:
        load_model(demo_settings.replace(model=str(path)))
    message = str(raised.value)
    assert phrase in message and str(path.resolve()) in message
    assert "omni_local loads symmetric int4 weights with group-wise scales (W4A16, pack-quantized)" in message


def _int4_config(ignore: list[str], group_size: int = 32) -> QuantizationConfig:
    scheme = SCHEMES["W4A16"]()
    scheme.weights.group_size = group_size
    return QuantizationConfig(config_groups={"group_0": scheme}, ignore=ignore, format="pack-quantized",
                              quantization_status="compressed")


# name -> (the config, a pattern the error must hold)
UNLOADABLE_LAYERS = {
    "the MoE routers quantized": (
        _int4_config([entry for entry in IGNORE if "mlp\\.gate" not in entry]),
        r"group_0 covers (thinker|talker)\.model\.layers\.\d\.mlp\.gate "
        r"\(Qwen3OmniMoe(Thinker|Talker)TextTopKRouter\), which omni_local keeps in the model's dtype"),
    "one expert of a layer left in full precision": (
        _int4_config([*IGNORE, "re:thinker\\.model\\.layers\\.0\\.mlp\\.experts\\.0\\."]),
        re.escape("the routed experts of thinker.model.language_model.layers.0.mlp.experts are stored in full "
                  "precision and int4 (group_0); omni_local's kernels read a layer's experts in one format")),
    "groups that do not divide a layer's inputs": (
        _int4_config(IGNORE, group_size=64), "int4 groups of 64 inputs do not divide the 32 inputs of "),
}


@pytest.mark.parametrize("case", UNLOADABLE_LAYERS)
def test_a_config_covering_a_layer_we_cannot_load_quantized_is_refused_naming_the_layer(
    case, demo_settings, compressed, tmp_path
):
    config, pattern = UNLOADABLE_LAYERS[case]
    path = copy_with_config(compressed["W4A16"], tmp_path / "copy", config)
    with pytest.raises(CheckpointError, match=r"checkpoint '.*copy'") as raised:
        load_model(demo_settings.replace(model=str(path)))
    assert re.search(pattern, str(raised.value))


def _drop_a_scale(weights: dict[str, torch.Tensor]) -> None:
    del weights["thinker.model.layers.0.self_attn.q_proj.weight_scale"]


def _scales_as_integers(weights: dict[str, torch.Tensor]) -> None:
    name = "thinker.model.layers.1.mlp.experts.2.up_proj.weight_scale"
    weights[name] = weights[name].to(torch.int32)


NOT_FITTING = {
    "a layer's scales missing": (_drop_a_scale, "lacks 1 weight(s): "
                                 "thinker.model.language_model.layers.0.self_attn.q_proj.weight_scale"),
    "a layer's scales stored as integers": (_scales_as_integers,
                                            "holds thinker.model.layers.1.mlp.experts.2.up_proj.weight_scale in I32, "
                                            "but its quantization config stores it in F32 or BF16 or F16"),
}


@pytest.mark.parametrize("case", NOT_FITTING)
def test_stored_tensors_that_do_not_fit_the_config_are_refused_before_any_is_read(
    case, demo_settings, compressed, tmp_path
):
    edit, phrase = NOT_FITTING[case]
    path = shutil.copytree(compressed["FP8"], tmp_path / "edited")
    weights = load_file(path / "model.safetensors")
    edit(weights)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as raised:
        load_model(demo_settings.replace(model=str(path)))
    assert phrase in str(raised.value)


def test_the_memory_plan_counts_a_quantized_checkpoints_layers_at_their_stored_size(compressed_app, monkeypatch):
    from omni_local.engine import memory_plan

    monkeypatch.setattr(memory_plan, "FIRST_START_ENGINE_BYTES", 1 << 20)
    settings = compressed_app.settings.replace(gpu_memory_bytes=4 << 30)
    with OmniLocal(settings) as planned:
        model = planned.backend.loaded.model
        held = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        assert planned.backend.memory.weights == held
