"""The GPU memory plan (engine/memory_plan.py): before any weight is read, the weights' exact size in
the chosen format, the engine's take and the encoder outputs are set against the memory there is;
the KV gets the rest, up to gpu_cache_bytes, and settings that cannot fit stop start-up saying what
would. On the CPU the plan runs where `gpu_memory_bytes` is set, as these tests set it."""

import pytest
import torch

from omni_local.api import OmniLocal
from omni_local.engine import memory_plan
from omni_local.engine.thinker import kv_shape, least_kv_bytes
from omni_local.errors import SettingsError
from omni_local.model import load_model, weights as weights_module
from omni_local.model.quantized import weights_bytes

MiB = 1 << 20
ENGINE = 1 * MiB  # the engine's take a first start plans with, at the demo's size


@pytest.fixture
def planned(demo_settings, demo_checkpoint, monkeypatch, tmp_path):
    monkeypatch.setattr(memory_plan, "FIRST_START_ENGINE_BYTES", ENGINE)
    return demo_settings.replace(speech=True, encoder_cache_bytes=MiB, cache_dir=str(tmp_path / "cache"))


def held_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


@pytest.mark.parametrize("speech", [True, False])
@pytest.mark.parametrize("weights", ["bf16", "fp8", "int4"])
def test_the_planned_weights_are_the_loaded_models_bytes_in_each_format(planned, weights, speech):
    full_precision = load_model(planned.replace(speech=speech)).model

    loaded = load_model(planned.replace(weights=weights, speech=speech)).model

    assert weights_bytes(full_precision, weights, speech) == held_bytes(loaded)


def test_the_kv_is_what_the_plan_leaves_up_to_gpu_cache_bytes(planned, tmp_path):
    with OmniLocal(planned.replace(gpu_memory_bytes=1 << 30)) as roomy:
        assert roomy.backend.memory.kv == planned.gpu_cache_bytes
        weights = held_bytes(roomy.backend.loaded.model)
        assert roomy.backend.memory.weights == weights

    available = weights + ENGINE + MiB + 5 * MiB
    # A cache folder of its own: on a GPU the first start's measured take is remembered in the other.
    with OmniLocal(planned.replace(gpu_memory_bytes=available, cache_dir=str(tmp_path / "first start"))) as tight:
        plan = tight.backend.memory
        assert plan.kv == 5 * MiB and plan.engine == ENGINE and plan.encoder_outputs == MiB
        kv = tight.backend.engine.runner.kv
        assert kv.allocated_bytes <= plan.kv and kv.allocated_bytes > plan.kv - kv.shape.block_bytes(kv.dtype)
        assert tight.session().send("Hello there", max_new_tokens=4).result().tokens.generated > 0


def test_settings_that_cannot_fit_stop_start_up_before_any_weight_is_read_saying_what_would(planned, monkeypatch):
    model = load_model(planned).model
    thinker_kv = kv_shape(model.thinker.model.language_model.config, planned.max_context_tokens,
                          planned.kv_block_tokens, model.config.talker_config.text_config.hidden_size)
    one_conversation = least_kv_bytes(thinker_kv, torch.float32)
    available = weights_bytes(model, "bf16") + ENGINE + MiB + one_conversation - 1  # the others fit
    assert weights_bytes(model, "fp8") < weights_bytes(model, "bf16") - 1

    def read(*args):
        raise AssertionError("a weight was read")

    monkeypatch.setattr(weights_module, "_stream_file", read)
    with pytest.raises(SettingsError) as refusal:
        OmniLocal(planned.replace(gpu_memory_bytes=available))

    message = str(refusal.value)
    assert message.startswith("the model needs ") and " of GPU memory (weights " in message
    assert message.endswith("is free: try weights = 'fp8' or weights = 'int4' or speech = false")


def test_a_refusal_where_a_smaller_encoder_cache_fits_suggests_the_largest_that_does(planned, monkeypatch):
    monkeypatch.setattr(memory_plan, "LEAST_ENCODER_CACHE_BYTES", MiB)
    monkeypatch.setattr(memory_plan, "ENCODER_CACHE_STEP", MiB)
    model = load_model(planned).model
    thinker_kv = kv_shape(model.thinker.model.language_model.config, planned.max_context_tokens,
                          planned.kv_block_tokens, model.config.talker_config.text_config.hidden_size)
    available = weights_bytes(model, "bf16") + ENGINE + least_kv_bytes(thinker_kv, torch.float32) + 2 * MiB + 1

    with pytest.raises(SettingsError) as refusal:
        memory_plan.plan_memory(model, planned.replace(encoder_cache_bytes=8 * MiB, gpu_memory_bytes=available),
                                torch.device("cpu"))

    assert str(refusal.value).endswith(" is free: try encoder_cache_bytes = 2097152 (2.0 MiB)")  # in steps of 1 MiB


def test_with_the_encoder_cache_off_the_plan_keeps_no_room_for_encoder_outputs(planned):
    model = load_model(planned).model
    settings = planned.replace(encoder_cache_bytes=64 * MiB, gpu_memory_bytes=1 << 30, gpu_cache_bytes=1 << 30)

    on = memory_plan.plan_memory(model, settings, torch.device("cpu"))
    off = memory_plan.plan_memory(model, settings.replace(encoder_cache=False), torch.device("cpu"))

    assert on.encoder_outputs == 64 * MiB and off.encoder_outputs == 0
    assert off.kv == on.kv + 64 * MiB


def test_no_plan_is_made_on_the_cpu_unless_gpu_memory_bytes_is_set(planned):
    with OmniLocal(planned.replace(device="cpu")) as app:  # on the CPU, even where the tests run the demo on a GPU
        assert app.backend.memory is None
        assert app.backend.engine.settings.gpu_cache_bytes == planned.gpu_cache_bytes


@pytest.mark.cuda
def test_on_a_gpu_the_engines_take_is_measured_at_start_up_and_planned_with_at_the_next(planned):
    if not torch.cuda.is_available() or planned.device != "cuda":
        pytest.skip("the GPU tests run with OMNI_LOCAL_TEST_DEVICE=cuda")
    settings = planned.replace(gpu_memory_bytes=8 << 30)
    with OmniLocal(settings) as first:
        assert first.backend.memory.engine == ENGINE
    with OmniLocal(settings) as second:
        measured = second.backend.memory.engine
        assert measured != ENGINE and 0 < measured < torch.cuda.max_memory_allocated()
