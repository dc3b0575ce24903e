"""A checkpoint quantized before loading, as compressed-tensors 0.20 writes the community's 4-bit
(W4A16) and FP8 Qwen3-Omni checkpoints (compressed_checkpoints.py writes the demo so, with that
package's own code): it loads in its own format with no full-precision step, holds the very bytes
compressed-tensors packed, and answers as transformers' `generate` does on the loaded model; a
quantization it cannot load is refused at start-up, naming the part."""

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

from device_under_test import TEST_DEVICE

# compressed-tensors is a test dependency here (pyproject's test extra, so CI has it); the GPU
# machine's image lacks it, and a failed import would stop the collection of every other file.
if TEST_DEVICE == "cuda" and importlib.util.find_spec("compressed_tensors") is None:
    pytest.skip("compressed-tensors is not installed on this GPU machine", allow_module_level=True)

from compressed_tensors.compressors import FloatQuantizationCompressor, PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from compressed_checkpoints import SCHEMES, write_compressed, write_quantization_config  # noqa: E402
from moe_cases import ROUTES, logits_choosing  # noqa: E402
from replies import assert_spoken_reply_is_generates, assert_written_reply_is_generates  # noqa: E402
from samples import QUESTIONS  # noqa: E402
from omni_local.api import OmniLocal  # noqa: E402
from omni_local.errors import SettingsError  # noqa: E402
from omni_local.model import load_model  # noqa: E402
from omni_local.model.checkpoint_names import expert_slice, fused_rows, model_name  # noqa: E402
from omni_local.model.quantized import QuantizedExperts, QuantizedLinear, Quantized, dequantize, encoder_towers  # noqa: E402
from omni_local.model.quantized import experts as experts_module  # noqa: E402
from omni_local.model.quantized import linear as linear_module  # noqa: E402

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
        values, scales = ours.values.cpu(), ours.scales.cpu()  # the stored tensors are read to the CPU
        if scheme == "W4A16":
            assert torch.equal(values, parts["weight_packed"].view(torch.uint8)), layer
            assert torch.equal(scales, parts["weight_scale"]), layer
        else:
            assert torch.equal(values.view(torch.uint8), parts["weight"].view(torch.uint8)), layer
            assert torch.equal(scales, parts["weight_scale"].flatten()), layer
        theirs = compressor.decompress(parts, written.config_groups["group_0"])["weight"]
        assert torch.equal(dequantize(ours, torch.float32).cpu(), theirs), layer
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
    from omni_local.engine.forward.moe.block import renormalizes
    from omni_local.kernels.moe.routed_experts import weighted_expert_rows
    from omni_local.kernels.moe.tile_configs import GemmTile, TileConfig

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
    device = compressed_app.backend.engine.runner.device
    assert compressed_app.info.runs_on == f"float32 on {device}, {format} weights, as the checkpoint holds them"


@pytest.mark.parametrize("case", QUESTIONS)
def test_a_written_reply_is_transformers_generate_on_the_loaded_model(compressed_app, case):
    assert_written_reply_is_generates(compressed_app, QUESTIONS[case]())


def test_a_spoken_reply_has_the_codes_of_transformers_generate_on_the_loaded_model(compressed_app):
    assert_spoken_reply_is_generates(compressed_app, "Sing me a song about the sea.")


def test_named_in_the_weights_setting_its_format_quantizes_nothing_else_and_is_planned_at_the_stored_size(
    compressed_app, monkeypatch
):
    from omni_local.engine.sizing import memory_plan

    monkeypatch.setattr(memory_plan, "FIRST_START_ENGINE_BYTES", 1 << 20)
    format = compressed_app.backend.loaded.quantized.split()[0]  # int4 would add our int8 layers to a checkpoint's own
    settings = compressed_app.settings.replace(gpu_memory_bytes=4 << 30, weights=format)
    with OmniLocal(settings) as planned:
        model = planned.backend.loaded.model
        held = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        assert planned.backend.memory.weights == held
        assert isinstance(model.thinker.lm_head, torch.nn.Linear)
        assert isinstance(model.thinker.get_input_embeddings(), torch.nn.Embedding)
        encoders = [module for tower in encoder_towers(model) for module in tower.modules()]
        assert not any(isinstance(module, QuantizedLinear) for module in encoders)
