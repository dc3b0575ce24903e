"""A GPTQ-packed int4 checkpoint, as AutoRound exports the community's calibrated 4-bit Qwen3-Omni
checkpoints in both of its configs (gptq_checkpoints.py writes the demo so): it loads into our int4
with no full-precision step, each packed layer dequantizing to the very weight it stands for, and
answers, greedy, as the same checkpoint with those weights in float32 does; a quantization our int4
cannot hold is refused at start-up, naming the field."""

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gptq_checkpoints import FLAVOURS, GROUP_SIZE, with_quantization_config, write_dequantized, write_gptq
from samples import QUESTIONS
from omni_local.api import OmniLocal
from omni_local.errors import CheckpointError, SettingsError
from omni_local.model import load_model
from omni_local.model.quantized import QuantizedExperts, QuantizedLinear, dequantize
from omni_local.model.quantized import experts as experts_module
from omni_local.model.quantized import linear as linear_module
from replies import NEW_TOKENS, media

LAYERS = 4  # the demo Thinker's
# What AutoRound packs of Qwen3-Omni, by the names of the full-precision model's parameters.
PACKED = {f"thinker.model.language_model.layers.{i}.{part}" for i in range(LAYERS) for part in
          (*(f"self_attn.{p}_proj.weight" for p in "qkvo"), "mlp.experts.gate_up_proj", "mlp.experts.down_proj")}
V2_ZERO = 0x88888888 - (1 << 32)  # eight nibbles of the zero 8 as it is (GPTQ v2), as a signed int32


@pytest.fixture(scope="module")
def written(demo_checkpoint, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gptq")
    paths = {flavour: write_gptq(demo_checkpoint, root / flavour, flavour) for flavour in FLAVOURS}
    return paths | {"dequantized": write_dequantized(demo_checkpoint, root / "dequantized")}


@pytest.fixture(scope="module")
def dequantized_weights(demo_settings, written) -> dict[str, torch.Tensor]:
    return dict(load_model(demo_settings.replace(model=str(written["dequantized"]))).model.named_parameters())


def held_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each quantized layer's weight dequantized to float32, by its parameter's name in the
    full-precision model."""
    weights = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            weights[f"{name}.weight"] = dequantize(module.weight, torch.float32)
        elif isinstance(module, QuantizedExperts):
            weights[f"{name}.gate_up_proj"] = dequantize(module.gate_up, torch.float32)
            weights[f"{name}.down_proj"] = dequantize(module.down, torch.float32)
    return weights


def with_tensors(checkpoint: Path, target: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """A copy of `checkpoint` whose tensors `change` has edited in place."""
    shutil.copytree(checkpoint, target)
    tensors = load_file(target / "model.safetensors")
    change(tensors)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


def gptq_v2(tensors: dict[str, torch.Tensor]) -> None:
    for name in tensors:
        if name.endswith(".qzeros"):
            tensors[name] = torch.full_like(tensors[name], V2_ZERO)


def groups_reversed(tensors: dict[str, torch.Tensor]) -> None:
    """Layer 1's q_proj as activation order would store it: its inputs' groups permuted."""
    name = "thinker.model.layers.1.self_attn.q_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()


# Loading


VARIANTS = {
    "gptq": lambda written, root: written["gptq"],
    "auto-round": lambda written, root: written["auto-round"],
    "gptq v2 (zero points stored as they are)": lambda written, root: with_quantization_config(
        with_tensors(written["gptq"], root / "v2-tensors", gptq_v2), root / "v2", checkpoint_format="gptq_v2"),
    "desc_act true, its g_idx in input order": lambda written, root: with_quantization_config(
        written["gptq"], root / "desc_act", desc_act=True),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_packed_layer_is_held_in_our_int4_and_dequantizes_to_the_weight_it_stands_for(
    variant, demo_settings, written, dequantized_weights, tmp_path, monkeypatch
):
    def refused(*args, **kwargs):
        raise AssertionError("a packed layer was quantized again from full precision")

    monkeypatch.setattr(QuantizedExperts, "take_expert_weight", refused)
    monkeypatch.setattr(experts_module, "quantize", refused)
    monkeypatch.setattr(linear_module, "quantize", refused)
    path = VARIANTS[variant](written, tmp_path)
    loaded = load_model(demo_settings.replace(model=str(path), speech=True))

    held = held_weights(loaded.model)
    assert held.keys() == PACKED  # not the routers, the Talker, the towers or the heads
    for name, weight in held.items():
        assert torch.equal(weight.cpu(), dequantized_weights[name].cpu()), name
    groups = {module.weight.group for module in loaded.model.modules() if isinstance(module, QuantizedLinear)}
    assert groups == {GROUP_SIZE}
    assert loaded.quantized == "int4 weights, as the checkpoint holds them"


def test_the_weights_setting_may_name_int4_but_not_another_format(demo_settings, written):
    with pytest.raises(SettingsError) as raised:
        load_model(demo_settings.replace(model=str(written["gptq"]), weights="fp8"))
    assert ("is already quantized (int4, gptq) and loads as it is: setting 'weights' must be 'bf16' or 'int4', "
            "not 'fp8'") in str(raised.value)


REFUSED = {
    "8-bit": ("gptq", {"bits": 8}, None, "quantization config (gptq): bits 8 is not supported"),
    "asymmetric": ("auto-round", {"sym": False}, None, "quantization config (auto-round): sym false "
                   "(asymmetric weights, with zero points) is not supported"),
    "a scale per row": ("gptq", {"group_size": -1}, None,
                        "group_size -1 (a power of two of at least 16 loads) is not supported"),
    "another GPTQ format": ("gptq", {"checkpoint_format": "marlin"}, None,
                            "checkpoint_format 'marlin' (the GPTQ formats 'gptq' and 'gptq_v2' load) is not supported"),
    "words of 16 bits": ("gptq", {"pack_dtype": "int16"}, None,
                         "pack_dtype 'int16' (words of int32 load) is not supported"),
    "another quantization method": ("gptq", {"quant_method": "awq"}, None,
                                    "quant_method 'awq' is not supported (omni_local reads checkpoints quantized "
                                    "with compressed-tensors, and GPTQ-packed int4: 'gptq' or 'auto-round')"),
    "a dynamic entry that is no regex": ("gptq", {"dynamic": {"-:[": {}}}, None,
                                         "dynamic entry '-:[' (not a regex) is not supported"),
    "experts overridden to 8 bits": ("gptq", {"dynamic": {"+:.*experts.*": {"bits": 8}}}, None,
                                     "bits 8 is not supported for thinker.model.layers.0.mlp.experts."),
    "a packed layer said unquantized (dynamic)": (
        "gptq", {"dynamic": {"-:.*self_attn.*": {}}}, None,
        "quantization config: dynamic entry '.*self_attn.*' leaves thinker.model.layers.0.self_attn."),
    "a packed layer said unquantized (extra_config)": (
        "auto-round", {"extra_config": {"thinker.model.layers.2.self_attn.q_proj": {"bits": 16}}}, None,
        "extra_config entry 'thinker.model.layers.2.self_attn.q_proj' leaves thinker.model.layers.2.self_attn.q_proj "
        "unquantized, but the checkpoint holds it GPTQ-packed (its qweight)"),
    "zero points stored as they are, said v1": ("gptq", {}, gptq_v2, "qzeros holds zero points other than the "
                                                "symmetric 7 its format stores (gptq)"),
    "activation order": ("gptq", {"desc_act": True}, groups_reversed,
                         "thinker.model.language_model.layers.1.self_attn.q_proj.g_idx is not in input order "
                         "(desc_act: activation order, the inputs' groups permuted)"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_quantization_our_int4_cannot_hold_is_refused_naming_the_field(case, demo_settings, written, tmp_path):
    flavour, changes, change_tensors, message = REFUSED[case]
    path = written[flavour]
    if change_tensors is not None:
        path = with_tensors(path, tmp_path / "tensors", change_tensors)
    path = with_quantization_config(path, tmp_path / "config", **changes)
    with pytest.raises(CheckpointError) as raised:
        load_model(demo_settings.replace(model=str(path)))
    assert message in str(raised.value)
    assert str(path) in str(raised.value)


# Answers


@pytest.fixture(scope="module", params=FLAVOURS)
def gptq_app(request, demo_settings, written):
    with OmniLocal(demo_settings.replace(model=str(written[request.param]))) as app:
        yield app


@pytest.fixture(scope="module")
def dequantized_app(demo_settings, written):
    with OmniLocal(demo_settings.replace(model=str(written["dequantized"]))) as app:
        yield app


def greedy_reply(app: OmniLocal, parts: list) -> list[int]:
    return app.session().send(parts[-1], max_new_tokens=NEW_TOKENS, **media(parts)).result().token_ids


@pytest.mark.parametrize("case", QUESTIONS)
def test_a_greedy_reply_is_the_one_the_dequantized_weights_give(gptq_app, dequantized_app, case):
    assert gptq_app.info.runs_on.endswith("int4 weights, as the checkpoint holds them")
    ours = greedy_reply(gptq_app, QUESTIONS[case]())
    assert ours == greedy_reply(dequantized_app, QUESTIONS[case]())
    assert len(ours) > 8
