"""The GPU memory plan (engine/memory_plan.py): before any weight is read, the weights' exact size in
the chosen format, the engine's take and the encoder outputs are set against the memory there is;
the KV gets the rest, up to gpu_cache_bytes, and settings that cannot fit stop start-up saying what
would. On the CPU the plan runs where `gpu_memory_bytes` is set, as these tests set it."""

import pytest
import torch

from omni_local.api import OmniLocal
from omni_local.engine import expert_placement, memory_plan
from omni_local.engine.thinker import kv_shape, least_kv_bytes
from omni_local.errors import SettingsError
from omni_local.model import load_model, weights as weights_module
from omni_local.model.host_experts import in_host_memory, thinker_experts
from omni_local.model.quantized import weights_bytes
from omni_local.settings import Settings

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
        assert tight.backend.engine.settings.encoder_cache_bytes == plan.encoder_outputs
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
    with pytest.raises(SettingsError) as refusal:  # every layer's experts kept on the GPU
        OmniLocal(planned.replace(gpu_memory_bytes=available, experts_on_gpu=LAYERS))

    message = str(refusal.value)
    assert message.startswith("the model needs ") and " of GPU memory (weights " in message
    assert message.endswith("is free: try encoder_cache = false or experts_on_gpu = 3 or weights = 'fp8' or "
                            "weights = 'int4' or speech = false")


def test_where_the_weights_do_not_fit_the_plan_puts_the_experts_of_the_fewest_last_layers_in_host_memory(planned):
    model = load_model(planned).model
    each = layer_bytes(model)
    weights = weights_bytes(model, "bf16")
    fits = weights + ENGINE + MiB + one_conversation_kv(model, planned)

    plans = {short: plan(model, planned.replace(gpu_memory_bytes=fits - short)) for short in (0, 1, each, each + 1)}

    assert {short: p.experts_on_gpu for short, p in plans.items()} == {0: 4, 1: 3, each: 3, each + 1: 2}
    two = plans[each + 1]
    assert (two.weights, two.host_experts, two.layers) == (weights - 2 * each, 2 * each, LAYERS)
    expert = each // 4  # the demo's 4 experts, 2 of them routed a token
    assert two.bus_bytes_per_token == 2 * 2 * expert
    assert (f"weights {memory_plan.size(two.weights)} (the experts of the last 2 of 4 layers in host memory, "
            f"{memory_plan.size(2 * each)}: 0 MB over the bus a decoded token, at most ") in two.line()
    assert "host memory" not in plans[0].line()


def test_experts_on_gpu_keeps_the_first_n_layers_experts_on_the_gpu_whatever_the_room(planned):
    model = load_model(planned).model
    each = layer_bytes(model)
    roomy = plan(model, planned.replace(gpu_memory_bytes=1 << 30, experts_on_gpu=1))
    past_the_layers = plan(model, planned.replace(gpu_memory_bytes=1 << 30, experts_on_gpu=9))

    assert (roomy.experts_on_gpu, roomy.host_experts) == (1, 3 * each)
    assert (past_the_layers.experts_on_gpu, past_the_layers.host_experts) == (4, 0)


def test_a_card_too_small_with_every_layers_experts_in_host_memory_is_refused_saying_so(planned):
    model = load_model(planned).model
    on_gpu = weights_bytes(model, "bf16") - LAYERS * layer_bytes(model)  # every layer's experts in host memory
    least = on_gpu + ENGINE + MiB + one_conversation_kv(model, planned)

    fitting = plan(model, planned.replace(gpu_memory_bytes=least))
    with pytest.raises(SettingsError) as refusal:
        plan(model, planned.replace(gpu_memory_bytes=least - 1))

    assert fitting.experts_on_gpu == 0
    assert f" (weights {memory_plan.size(on_gpu)} with the experts of 4 of 4 layers in host memory, the engine, " \
        in str(refusal.value)
    assert str(refusal.value).endswith("is free: try encoder_cache = false or weights = 'fp8' or weights = 'int4' or "
                                       "speech = false")


def test_experts_that_would_take_more_than_half_the_machines_memory_are_refused_naming_what_fits(
    planned, monkeypatch
):
    model = load_model(planned).model
    each = layer_bytes(model)
    fits = weights_bytes(model, "bf16") + ENGINE + MiB + one_conversation_kv(model, planned)
    settings = planned.replace(gpu_memory_bytes=fits - 2 * each)  # two layers' experts to host memory
    monkeypatch.setattr(expert_placement, "machine_memory_bytes", lambda: 4 * each - 2)  # half: one byte short

    with pytest.raises(SettingsError) as refusal:
        plan(model, settings)
    monkeypatch.setattr(expert_placement, "machine_memory_bytes", lambda: 4 * each)

    assert plan(model, settings).host_experts == 2 * each
    assert str(refusal.value) == (
        f"the model fits {memory_plan.size(fits - 2 * each)} of GPU memory with the experts of 2 of 4 layers in host "
        f"memory, but they take {memory_plan.size(2 * each)} of it, more than the {memory_plan.size(2 * each - 1)} "
        "page-locked weights may take (1/2 of this machine's memory): try encoder_cache = false or weights = 'fp8' "
        "or weights = 'int4' or speech = false")  # at the demo's size, 1 MiB of encoder outputs outweighs 2 layers


@pytest.mark.parametrize("weights", ["bf16", "fp8", "int4"])
def test_the_app_starts_with_the_experts_the_plan_puts_in_host_memory_marked_and_answers(planned, weights):
    # On the CPU every tensor is in host memory already: the marks are all that placement changes here.
    model = load_model(planned).model
    fits = weights_bytes(model, weights) + ENGINE + MiB + one_conversation_kv(model, planned)
    with OmniLocal(planned.replace(weights=weights, gpu_memory_bytes=fits - 1)) as app:  # a byte short
        assert app.backend.memory.experts_on_gpu == 3
        assert [in_host_memory(e) for e in thinker_experts(app.backend.loaded.model)] == [False, False, False, True]
        assert app.session().send("Hello there", max_new_tokens=4).result().tokens.generated > 0


def test_experts_on_gpu_below_minus_one_is_refused():
    with pytest.raises(SettingsError, match="setting 'experts_on_gpu' must be -1 .* got -2"):
        Settings(experts_on_gpu=-2)


LAYERS = 4  # the demo Thinker's


def layer_bytes(model: torch.nn.Module) -> int:
    """One demo Thinker layer's experts in float32 (each layer's are the same size)."""
    experts = thinker_experts(model)[0]
    return (experts.gate_up_proj.numel() + experts.down_proj.numel()) * 4


def one_conversation_kv(model: torch.nn.Module, settings) -> int:
    return memory_plan.least_conversation_kv_bytes(model, settings, torch.float32)


def plan(model: torch.nn.Module, settings) -> memory_plan.MemoryPlan:
    return memory_plan.plan_memory(model, settings, torch.device("cpu"))


def test_where_memory_is_short_the_encoder_outputs_shrink_to_their_floor_before_the_kv_falls_below_four_chats(
    planned, monkeypatch
):
    monkeypatch.setattr(memory_plan, "LEAST_ENCODER_CACHE_BYTES", 2 * MiB)
    model = load_model(planned).model
    thinker_kv = kv_shape(model.thinker.model.language_model.config, planned.max_context_tokens,
                          planned.kv_block_tokens, model.config.talker_config.text_config.hidden_size)
    block = thinker_kv.block_bytes(torch.float32)
    four_chats = (thinker_kv.blocks_for(memory_plan.KV_TARGET_TOKENS) + 1) * block  # and the pad block
    settings = planned.replace(encoder_cache_bytes=64 * MiB, gpu_cache_bytes=1 << 30)
    base = weights_bytes(model, "bf16", speech=True) + ENGINE

    def plan(spare: int) -> memory_plan.MemoryPlan:
        return memory_plan.plan_memory(model, settings.replace(gpu_memory_bytes=base + four_chats + spare),
                                       torch.device("cpu"))

    assert (plan(74 * MiB).encoder_outputs, plan(74 * MiB).kv) == (64 * MiB, four_chats + 10 * MiB)
    assert (plan(16 * MiB).encoder_outputs, plan(16 * MiB).kv) == (16 * MiB, four_chats)
    shortest = plan(0)
    assert (shortest.encoder_outputs, shortest.kv) == (2 * MiB, four_chats - 2 * MiB)
    tokens = (shortest.kv // block - 1) * thinker_kv.block_tokens
    assert shortest.kv_tokens == tokens and tokens < memory_plan.KV_TARGET_TOKENS
    assert shortest.line().endswith(f"encoder outputs 2.0 MiB (of 64.0 MiB: shrunk to fit), KV "
                                    f"{memory_plan.size(shortest.kv)} "
                                    f"({tokens:,} tokens: {tokens / 4096:.1f} chats of 4,096)")


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


def test_each_start_up_step_says_the_gpu_memory_it_kept_allocated_and_reserved(monkeypatch, caplog):
    # Which part of the engine's take is which (graphs, pools, activations): the plan sizes the whole.
    from omni_local import start_up_steps

    readings = iter([(100 * MiB, 200 * MiB), (612 * MiB, 840 * MiB)])  # as the step begins, as it ends
    monkeypatch.setattr(start_up_steps, "gpu_memory", lambda: next(readings))
    monkeypatch.setattr(start_up_steps.time, "perf_counter", iter([1.0, 3.5]).__next__)
    with caplog.at_level("INFO", logger="omni_local.start_up"), start_up_steps.start_up_step("the graphs"):
        pass
    assert caplog.messages == ["start-up: the graphs, 2.5 s, GPU +512.0 MiB allocated, +640.0 MiB reserved"]
