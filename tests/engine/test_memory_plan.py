"""The GPU memory plan (engine/sizing/memory_plan.py): before any weight is read, the weights' exact size in
the chosen format, the engine's take and the encoder outputs are set against the memory there is;
the KV gets the rest, up to gpu_cache_bytes, and settings that cannot fit stop start-up saying what
would. On the CPU the plan runs where `gpu_memory_bytes` is set, as these tests set it."""

import json
from pathlib import Path

import pytest
import torch

from omni_local.api import OmniLocal
from omni_local.backends import local as local_backend
from omni_local.engine.forward.speech import talker_sequence_rows
from omni_local.engine.forward.talker import talker_kv_shape
from omni_local.engine.forward.thinker import kv_shape, least_kv_bytes
from omni_local.engine.sizing import expert_placement, memory_plan
from omni_local.engine.sizing.kv_sizes import kv_sizes
from omni_local.errors import SettingsError
from omni_local.model import load_model, weights as weights_module
from omni_local.model.host_experts import in_host_memory, thinker_embeddings, thinker_experts
from omni_local.model.quantized import weights_bytes
from omni_local.settings import Settings

MiB = 1 << 20
ENGINE = 1 * MiB  # the engine's take a first start plans with, at the demo's size


@pytest.fixture
def planned(demo_settings, demo_checkpoint, monkeypatch, tmp_path):
    monkeypatch.setattr(memory_plan, "FIRST_START_ENGINE_BYTES", ENGINE)
    # Prefill forwards of a chunk: the prefill graphs have nothing to shrink (they have tests of their own).
    return demo_settings.replace(speech=True, encoder_cache_bytes=MiB, cache_dir=str(tmp_path / "cache"),
                                 prefill_forward_tokens=demo_settings.prefill_chunk_tokens)


def held_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


@pytest.mark.parametrize("speech", [True, False])
@pytest.mark.parametrize("weights", ["bf16", "fp8", "int4"])
def test_the_planned_weights_are_the_loaded_models_bytes_in_each_format(planned, weights, speech):
    full_precision = load_model(planned.replace(speech=speech)).model

    loaded = load_model(planned.replace(weights=weights, speech=speech)).model

    assert weights_bytes(full_precision, weights, speech) == held_bytes(loaded)


def test_the_kv_is_what_the_plan_leaves_up_to_gpu_cache_bytes_the_talkers_beside_it(planned, tmp_path):
    with OmniLocal(planned.replace(gpu_memory_bytes=1 << 30)) as roomy:
        kv = roomy.backend.engine.runner.kv
        block = kv.shape.block_bytes(kv.dtype)
        assert roomy.backend.memory.kv == kv.allocated_bytes == planned.gpu_cache_bytes // block * block
        assert roomy.backend.memory.talker_kv == roomy.backend.engine.speaker.runner.kv.allocated_bytes
        weights = held_bytes(roomy.backend.loaded.model)
        assert roomy.backend.memory.weights == weights

    # Room for 5 MiB of KV, the Talker's included; the KV target does not fit, so the embeddings move.
    available = weights + ENGINE + MiB + 5 * MiB
    # A cache folder of its own: on a GPU the first start's measured take is remembered in the other.
    with OmniLocal(planned.replace(gpu_memory_bytes=available, cache_dir=str(tmp_path / "first start"))) as tight:
        plan, engine = tight.backend.memory, tight.backend.engine
        assert plan.engine == ENGINE and plan.encoder_outputs == MiB and plan.host_embeddings > 0
        assert engine.settings.encoder_cache_bytes == plan.encoder_outputs
        thinker, talker = engine.runner.kv.allocated_bytes, engine.speaker.runner.kv.allocated_bytes
        assert (plan.kv, plan.talker_kv) == (thinker, talker)
        room = 5 * MiB + plan.host_embeddings
        assert thinker + talker <= room and talker > 0
        # One more block of the Thinker's (and the Talker's it brings) would not fit.
        with_one_more = thinker + block + talker_bytes(tight.backend.loaded.model, planned, thinker // block + 1)
        assert with_one_more > room
        assert tight.session().send("Hello there", max_new_tokens=4).result().tokens.generated > 0


def test_the_talkers_kv_holds_a_spoken_chat_of_max_context_tokens_per_chat_the_thinkers_kv_holds(planned):
    model = load_model(planned).model
    thinker = thinker_kv(model, planned)
    block = thinker.block_bytes(torch.float32)
    chat_blocks = planned.max_context_tokens // thinker.block_tokens  # 1,024 tokens: 64 blocks of 16
    for blocks, chats in ((chat_blocks, 0), (chat_blocks + 1, 1), (3 * chat_blocks, 2), (3 * chat_blocks + 1, 3)):
        room = blocks * block + talker_bytes(model, planned, blocks)
        sized = plan(model, planned.replace(gpu_memory_bytes=1 << 30, gpu_cache_bytes=blocks * block))
        assert (sized.kv, sized.talker_chats) == (blocks * block, chats)
        assert sized.kv + sized.talker_kv == room
    assert sized.line().endswith(f", and the Talker's KV {memory_plan.size(sized.talker_kv)} (3 spoken chats of 1,024)")
    without_speech = plan(model, planned.replace(speech=False, gpu_memory_bytes=1 << 30))
    assert (without_speech.talker_kv, without_speech.talker_chats) == (0, 0)
    assert "Talker" not in without_speech.line()


def test_an_engine_that_runs_out_of_gpu_memory_while_it_starts_is_refused_with_a_smaller_kv_to_try(
        planned, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB.")

    monkeypatch.setattr(local_backend, "Engine", out_of_memory)
    settings = planned.replace(gpu_memory_bytes=1 << 30)
    loaded = load_model(settings)
    kv = plan(loaded.model, settings).kv
    refusal = rf"ran out of memory while the engine started.*try gpu_cache_bytes = {kv // 2}$"
    with pytest.raises(SettingsError, match=refusal):
        OmniLocal(settings)
    # Half of one conversation's KV would hold none: another change is named.
    one_chat = settings.replace(
        gpu_cache_bytes=memory_plan.least_conversation_kv_bytes(loaded.model, settings, loaded.dtype))
    with pytest.raises(SettingsError, match=r"try speech = false, or a lower max_context_tokens$"):
        OmniLocal(one_chat)


def test_the_engines_measured_take_leaves_out_the_talkers_kv_with_the_thinkers(planned, monkeypatch):
    measured = []
    monkeypatch.setattr(local_backend, "remember_engine_bytes", lambda plan, settings, device, baseline, kv:
                        measured.append(kv))
    with OmniLocal(planned.replace(gpu_memory_bytes=1 << 30)) as app:
        engine = app.backend.engine
        assert measured == [engine.runner.kv.allocated_bytes + engine.speaker.runner.kv.allocated_bytes]


def test_settings_that_cannot_fit_stop_start_up_before_any_weight_is_read_saying_what_would(planned, monkeypatch):
    model = load_model(planned).model
    embeddings = embeddings_bytes(model)
    # A byte short with the embeddings in host memory; the others fit.
    available = weights_bytes(model, "bf16") + ENGINE + MiB + one_conversation_kv(model, planned) - embeddings - 1
    assert weights_bytes(model, "fp8") < weights_bytes(model, "bf16") - embeddings - 1

    def read(*args):
        raise AssertionError("a weight was read")

    monkeypatch.setattr(weights_module, "_stream_file", read)
    with pytest.raises(SettingsError) as refusal:  # every layer's experts kept on the GPU
        OmniLocal(planned.replace(gpu_memory_bytes=available, experts_on_gpu=LAYERS))

    message = str(refusal.value)
    assert message.startswith("the model needs ") and " of GPU memory (weights " in message
    assert message.endswith("is free: try encoder_cache = false or experts_on_gpu = 3 or weights = 'fp8' or "
                            "weights = 'int4' or speech = false")


def test_short_of_the_kv_target_the_plan_puts_the_input_embeddings_in_host_memory_and_no_experts(planned):
    model = load_model(planned).model
    weights, embeddings = weights_bytes(model, "bf16"), embeddings_bytes(model)
    target = weights + ENGINE + MiB + kv_target(model, planned)

    fits, short = plan(model, planned.replace(gpu_memory_bytes=target)), plan(model, planned.replace(
        gpu_memory_bytes=target - 1))

    assert (fits.host_embeddings, fits.weights, fits.experts_on_gpu) == (0, weights, LAYERS)
    assert (short.host_embeddings, short.weights, short.experts_on_gpu) == (embeddings, weights - embeddings, LAYERS)
    row = embeddings // model.config.thinker_config.text_config.vocab_size  # a token's: 64 float32 values
    assert short.bus_bytes_per_token == row == 256
    assert (f"weights {memory_plan.size(weights - embeddings)} (in host memory: the input embeddings, "
            f"{memory_plan.size(embeddings)}: 0.3 kB over the bus a decoded token), engine ") in short.line()
    assert "host memory" not in fits.line()


def test_where_the_floors_do_not_fit_the_plan_puts_the_experts_of_the_fewest_last_layers_in_host_memory_too(planned):
    model = load_model(planned).model
    each, embeddings = layer_bytes(model), embeddings_bytes(model)
    weights = weights_bytes(model, "bf16")
    fits = weights + ENGINE + MiB + one_conversation_kv(model, planned)
    shorts = (0, embeddings, embeddings + 1, embeddings + each, embeddings + each + 1)

    plans = {short: plan(model, planned.replace(gpu_memory_bytes=fits - short)) for short in shorts}

    assert [plans[short].experts_on_gpu for short in shorts] == [4, 4, 3, 3, 2]
    assert all(p.host_embeddings == embeddings for p in plans.values())
    two = plans[embeddings + each + 1]
    assert (two.weights, two.host_experts, two.layers) == (weights - embeddings - 2 * each, 2 * each, LAYERS)
    expert = each // 4  # the demo's 4 experts, 2 of them routed a token
    assert two.bus_bytes_per_token == 2 * 2 * expert + 256
    assert (f"weights {memory_plan.size(two.weights)} (in host memory: the input embeddings, "
            f"{memory_plan.size(embeddings)}; the experts of the last 2 of 4 layers, {memory_plan.size(2 * each)}: "
            "98.6 kB over the bus a decoded token, at most ") in two.line()


def test_embeddings_tied_to_lm_head_stay_on_the_gpu_where_the_kv_target_does_not_fit(planned, monkeypatch):
    model = load_model(planned).model
    weights = weights_bytes(model, "bf16")
    # As transformers marks a checkpoint whose config ties them (tie_word_embeddings): one table.
    tied = {"thinker.lm_head.weight": "thinker.model.language_model.embed_tokens.weight"}
    monkeypatch.setattr(model, "all_tied_weights_keys", tied)
    short = plan(model, planned.replace(gpu_memory_bytes=weights + ENGINE + MiB + kv_target(model, planned) - 1))

    assert thinker_embeddings(model) is None
    assert (short.host_embeddings, short.weights, short.experts_on_gpu) == (0, weights, LAYERS)


def test_experts_on_gpu_keeps_the_first_n_layers_experts_on_the_gpu_whatever_the_room(planned):
    model = load_model(planned).model
    each = layer_bytes(model)
    roomy = plan(model, planned.replace(gpu_memory_bytes=1 << 30, experts_on_gpu=1))
    past_the_layers = plan(model, planned.replace(gpu_memory_bytes=1 << 30, experts_on_gpu=9))

    assert (roomy.experts_on_gpu, roomy.host_experts) == (1, 3 * each)
    assert (past_the_layers.experts_on_gpu, past_the_layers.host_experts) == (4, 0)


def test_a_card_too_small_with_every_layers_experts_in_host_memory_is_refused_saying_so(planned):
    model = load_model(planned).model
    # The embeddings and every layer's experts in host memory
    on_gpu = weights_bytes(model, "bf16") - LAYERS * layer_bytes(model) - embeddings_bytes(model)
    least = on_gpu + ENGINE + MiB + one_conversation_kv(model, planned)

    fitting = plan(model, planned.replace(gpu_memory_bytes=least))
    with pytest.raises(SettingsError) as refusal:
        plan(model, planned.replace(gpu_memory_bytes=least - 1))

    assert fitting.experts_on_gpu == 0
    assert (f" (weights {memory_plan.size(on_gpu)} with the input embeddings and the experts of 4 of 4 layers in host "
            "memory, the engine, ") in str(refusal.value)
    assert str(refusal.value).endswith("is free: try encoder_cache = false or weights = 'fp8' or weights = 'int4' or "
                                       "speech = false")


def test_experts_that_would_take_more_than_half_the_machines_memory_are_refused_naming_what_fits(
    planned, monkeypatch
):
    model = load_model(planned).model
    each, embeddings = layer_bytes(model), embeddings_bytes(model)
    host = embeddings + 2 * each
    fits = weights_bytes(model, "bf16") + ENGINE + MiB + one_conversation_kv(model, planned)
    settings = planned.replace(gpu_memory_bytes=fits - host)  # the embeddings and two layers' experts to host memory
    monkeypatch.setattr(expert_placement, "machine_memory_bytes", lambda: 2 * host - 2)  # half: one byte short

    with pytest.raises(SettingsError) as refusal:
        plan(model, settings)
    monkeypatch.setattr(expert_placement, "machine_memory_bytes", lambda: 2 * host)

    assert (plan(model, settings).host_experts, plan(model, settings).host_embeddings) == (2 * each, embeddings)
    assert str(refusal.value) == (
        f"the model fits {memory_plan.size(fits - host)} of GPU memory with the input embeddings and the experts of 2 "
        f"of 4 layers in host memory, but they take {memory_plan.size(host)} of it, more than the "
        f"{memory_plan.size(host - 1)} page-locked weights may take (1/2 of this machine's memory): try encoder_cache = "
        "false or weights = 'fp8' or weights = 'int4' or speech = false")  # at the demo's size 1 MiB of encoder
    # outputs outweighs the embeddings and 2 layers


@pytest.mark.parametrize("weights", ["bf16", "fp8", "int4"])
def test_the_app_starts_with_the_experts_the_plan_puts_in_host_memory_marked_and_answers(planned, weights):
    # On the CPU every tensor is in host memory already: the marks are all that placement changes here.
    model = load_model(planned).model
    fits = weights_bytes(model, weights) + ENGINE + MiB + one_conversation_kv(model, planned)
    short = fits - embeddings_bytes(model, weights) - 1  # a byte short with the embeddings in host memory
    with OmniLocal(planned.replace(weights=weights, gpu_memory_bytes=short)) as app:
        assert app.backend.memory.experts_on_gpu == 3
        loaded = app.backend.loaded.model
        assert [in_host_memory(e) for e in thinker_experts(loaded)] == [False, False, False, True]
        assert in_host_memory(loaded.thinker.get_input_embeddings())
        assert app.session().send("Hello there", max_new_tokens=4).result().tokens.generated > 0


def test_experts_on_gpu_below_minus_one_is_refused():
    with pytest.raises(SettingsError, match="setting 'experts_on_gpu' must be -1 .* got -2"):
        Settings(experts_on_gpu=-2)


LAYERS = 4  # the demo Thinker's


def layer_bytes(model: torch.nn.Module) -> int:
    """One demo Thinker layer's experts in float32 (each layer's are the same size)."""
    experts = thinker_experts(model)[0]
    return (experts.gate_up_proj.numel() + experts.down_proj.numel()) * 4


def embeddings_bytes(model: torch.nn.Module, weights: str = "bf16") -> int:
    """The demo Thinker's input embeddings: 545 rows of 64 float32 values (int4: int8, a scale a row)."""
    rows, width = model.thinker.get_input_embeddings().weight.shape
    return rows * (width + 4) if weights == "int4" else rows * width * 4


def thinker_kv(model: torch.nn.Module, settings):
    return kv_shape(model.thinker.model.language_model.config, settings.max_context_tokens, settings.kv_block_tokens,
                    model.config.talker_config.text_config.hidden_size, fp8=settings.kv_dtype == "fp8")


def talker_bytes(model: torch.nn.Module, settings, thinker_blocks: int) -> int:
    """The Talker's KV beside `thinker_blocks` (the pad block among them): one of its longest sequences
    per chat of max_context_tokens those hold, and its pad block."""
    shape = talker_kv_shape(model.config.talker_config.text_config, talker_sequence_rows(settings, model.code2wav),
                            fp8=settings.kv_dtype == "fp8")
    chats = (thinker_blocks - 1) * settings.kv_block_tokens // settings.max_context_tokens
    return (chats * shape.table_blocks + 1) * shape.block_bytes(torch.float32)


def one_conversation_kv(model: torch.nn.Module, settings) -> int:
    """One conversation's Thinker KV, and the Talker's beside it."""
    thinker = thinker_kv(model, settings)
    return least_kv_bytes(thinker, torch.float32) + talker_bytes(model, settings, thinker.table_blocks + 1)


def kv_target(model: torch.nn.Module, settings) -> int:
    """The KV of four chats of 4,096 tokens (eight with fp8 KV), and the Talker's beside it."""
    thinker = thinker_kv(model, settings)
    tokens = memory_plan.KV_TARGET_TOKENS * (2 if settings.kv_dtype == "fp8" else 1)
    blocks = thinker.blocks_for(tokens) + 1  # and the pad block
    return blocks * thinker.block_bytes(torch.float32) + talker_bytes(model, settings, blocks)


def plan(model: torch.nn.Module, settings) -> memory_plan.MemoryPlan:
    return memory_plan.plan_memory(model, settings, torch.device("cpu"))


def test_where_memory_is_short_the_encoder_outputs_shrink_to_their_floor_before_the_kv_falls_below_four_chats(
    planned, monkeypatch
):
    monkeypatch.setattr(memory_plan, "LEAST_ENCODER_CACHE_BYTES", 2 * MiB)
    model = load_model(planned).model
    settings = planned.replace(speech=False, encoder_cache_bytes=64 * MiB, gpu_cache_bytes=1 << 30)
    thinker = kv_shape(model.thinker.model.language_model.config, planned.max_context_tokens, planned.kv_block_tokens, 0)
    block = thinker.block_bytes(torch.float32)
    four_chats = (thinker.blocks_for(memory_plan.KV_TARGET_TOKENS) + 1) * block  # and the pad block
    base = weights_bytes(model, "bf16", speech=False) + ENGINE

    def plan(spare: int) -> memory_plan.MemoryPlan:
        return memory_plan.plan_memory(model, settings.replace(gpu_memory_bytes=base + four_chats + spare),
                                       torch.device("cpu"))

    def blocks(room: int) -> int:  # whole blocks
        return room // block * block

    assert (plan(74 * MiB).encoder_outputs, plan(74 * MiB).kv) == (64 * MiB, four_chats + blocks(10 * MiB))
    assert (plan(16 * MiB).encoder_outputs, plan(16 * MiB).kv) == (16 * MiB, four_chats)
    shortest = plan(0)  # short of the KV target: the embeddings go to host memory first
    embeddings = shortest.host_embeddings
    assert shortest.kv == blocks(four_chats + embeddings - 2 * MiB)
    assert shortest.encoder_outputs == four_chats + embeddings - shortest.kv  # the floor, and what no block fills
    tokens = (shortest.kv // block - 1) * thinker.block_tokens
    assert shortest.kv_tokens == tokens and tokens < memory_plan.KV_TARGET_TOKENS
    assert shortest.line().endswith(f"encoder outputs 2.0 MiB (of 64.0 MiB: shrunk to fit), KV "
                                    f"{memory_plan.size(shortest.kv)} "
                                    f"({tokens:,} tokens: {tokens / 4096:.1f} chats of 4,096)")


def test_what_the_kvs_whole_blocks_leave_short_of_the_talkers_next_sequence_holds_encoder_outputs(planned,
                                                                                                    monkeypatch):
    monkeypatch.setattr(memory_plan, "LEAST_ENCODER_CACHE_BYTES", 2 * MiB)
    model = load_model(planned).model
    settings = planned.replace(encoder_cache_bytes=256 * MiB, gpu_cache_bytes=1 << 30)
    kv = kv_sizes(model, settings)
    # Short of the KV target, so the embeddings go to host memory; the room then left is the target's
    # blocks and the Talker's KV beside them, less a byte: one block short, the block whose tokens make
    # a chat more, so the Talker's next sequence is not there either.
    at_target = kv.blocks_for(memory_plan.KV_TARGET_TOKENS)
    assert kv.talker_bytes(at_target) > kv.talker_bytes(at_target - 1)
    base = weights_bytes(model, "bf16") - embeddings_bytes(model) + ENGINE + 2 * MiB

    short = plan(model, settings.replace(gpu_memory_bytes=base + kv.bytes(at_target) - 1))

    assert short.host_embeddings == embeddings_bytes(model)
    assert (short.kv, short.kv + short.talker_kv) == ((at_target - 1) * kv.block_bytes, kv.bytes(at_target - 1))
    leftover = kv.bytes(at_target) - 1 - kv.bytes(at_target - 1)  # a block, and a Talker sequence
    assert short.encoder_outputs == 2 * MiB + leftover


def test_with_fp8_kv_the_kv_target_is_twice_the_tokens_and_the_talkers_kv_is_fp8_too(planned):
    model = load_model(planned).model
    settings = planned.replace(encoder_cache_bytes=64 * MiB, gpu_cache_bytes=1 << 30, kv_dtype="fp8")
    # Room for every weight, the engine, the encoder outputs whole and the fp8 KV target: the KV gets the target.
    available = weights_bytes(model, "bf16") + ENGINE + 64 * MiB + kv_target(model, settings)

    fp8 = plan(model, settings.replace(gpu_memory_bytes=available))
    unquantized = plan(model, settings.replace(gpu_memory_bytes=available, kv_dtype="auto"))

    assert (fp8.kv_tokens, fp8.encoder_outputs) == (2 * memory_plan.KV_TARGET_TOKENS, 64 * MiB)
    assert fp8.talker_kv == talker_bytes(model, settings, fp8.kv // kv_sizes(model, settings).block_bytes)
    # The same memory holds fewer tokens unquantized, and each of its Talker sequences takes more.
    assert unquantized.kv_tokens < fp8.kv_tokens
    assert unquantized.talker_kv / unquantized.talker_chats > fp8.talker_kv / fp8.talker_chats


def test_short_of_the_kv_target_with_every_expert_on_the_gpu_the_prefill_graphs_shrink_before_any_expert_moves(
    planned, monkeypatch
):
    model = load_model(planned).model
    per_token = memory_plan.prefill_bytes_per_token(model)
    engine = 8192 * per_token  # a take whose halves the graphs' activations can save
    monkeypatch.setattr(memory_plan, "FIRST_START_ENGINE_BYTES", engine)
    settings = planned.replace(prefill_forward_tokens=4096, prefill_chunk_tokens=512)
    # Every expert on the GPU, the embeddings in host memory, the encoder outputs' floor and the KV target:
    base = weights_bytes(model, "bf16") - embeddings_bytes(model) + MiB + kv_target(model, planned)

    def planned_with(engine_room: int) -> memory_plan.MemoryPlan:
        return plan(model, settings.replace(gpu_memory_bytes=base + engine_room))

    assert planned_with(engine).prefill_forward_tokens == 4096
    at_1024 = planned_with(engine - 3072 * per_token)
    assert (at_1024.prefill_forward_tokens, at_1024.engine, at_1024.experts_on_gpu) == (
        1024, engine - 3072 * per_token, LAYERS)
    assert at_1024.applied(settings).prefill_forward_tokens == 1024
    assert at_1024.line().endswith("; prefill graphs of up to 1,024 tokens (prefill_forward_tokens 4,096: shrunk to fit)")
    shortest = planned_with(0)  # not even a chunk's graphs fit the target: a chunk's, and the KV as it can
    assert (shortest.prefill_forward_tokens, shortest.engine) == (512, engine - 3584 * per_token)
    assert "prefill graphs" not in planned_with(engine).line()


def test_a_shrunk_prefill_forward_plans_with_the_take_measured_at_it_once_there_is_one(planned):
    model = load_model(planned).model
    settings = planned.replace(prefill_forward_tokens=1024, prefill_chunk_tokens=512)
    measured_at_512 = 3 * MiB
    cache = Path(settings.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    key = memory_plan._key(model, settings.replace(prefill_forward_tokens=512), torch.device("cpu"))
    (cache / "memory.json").write_text(json.dumps({key: measured_at_512}), encoding="utf-8")

    # Room for the floors with that take, short of the KV target at either forward.
    floors = weights_bytes(model, "bf16") - embeddings_bytes(model) + MiB + one_conversation_kv(model, settings)
    short = plan(model, settings.replace(gpu_memory_bytes=floors + measured_at_512))

    assert (short.prefill_forward_tokens, short.engine, short.key) == (512, measured_at_512, key)


def test_the_prefill_forwards_halve_within_multiples_of_the_chunk():
    assert memory_plan.prefill_forward_choices(4096, 512) == [4096, 2048, 1024, 512]
    assert memory_plan.prefill_forward_choices(1536, 512) == [1536, 512]
    assert memory_plan.prefill_forward_choices(512, 512) == [512]


def test_with_the_encoder_cache_off_the_plan_keeps_no_room_for_encoder_outputs(planned):
    model = load_model(planned).model
    settings = planned.replace(speech=False, encoder_cache_bytes=64 * MiB, gpu_memory_bytes=1 << 30,
                               gpu_cache_bytes=1 << 30)
    room = (1 << 30) - weights_bytes(model, "bf16", speech=False) - ENGINE
    block = kv_shape(model.thinker.model.language_model.config, 1024, 16, 0).block_bytes(torch.float32)

    on = memory_plan.plan_memory(model, settings, torch.device("cpu"))
    off = memory_plan.plan_memory(model, settings.replace(encoder_cache=False), torch.device("cpu"))

    assert on.encoder_outputs == 64 * MiB and off.encoder_outputs == 0
    assert (on.kv, off.kv) == ((room - 64 * MiB) // block * block, room // block * block)


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
        assert measured != ENGINE and 0 < measured < torch.cuda.max_memory_reserved()


def test_each_start_up_step_says_the_gpu_memory_it_kept_allocated_and_reserved(monkeypatch, caplog):
    # Which part of the engine's take is which (graphs, pools, activations): the plan sizes the whole.
    from omni_local import start_up_steps

    readings = iter([(100 * MiB, 200 * MiB), (612 * MiB, 840 * MiB)])  # as the step begins, as it ends
    monkeypatch.setattr(start_up_steps, "gpu_memory", lambda: next(readings))
    monkeypatch.setattr(start_up_steps.time, "perf_counter", iter([1.0, 3.5]).__next__)
    with caplog.at_level("INFO", logger="omni_local.start_up"), start_up_steps.start_up_step("the graphs"):
        pass
    assert caplog.messages == ["start-up: the graphs, 2.5 s, GPU +512.0 MiB allocated, +640.0 MiB reserved"]
