"""The deterministic setting (engine/forward/batch_invariant.py) on the demo model, its kernels in Triton's
interpreter on the CPU run: a token's KV rows, its Talker row and the logits after it are the same
bits however the prompt was computed (one prefill, a tail on a cached prefix of any length, chunks,
or decode steps), which the default setting does not promise; and with it the caches change no
reply, spoken ones included."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image

from omni_local.engine.memory.attention.reference import gathered
from omni_local.engine.prompt.builder import Prompt, build_prompt
from omni_local.errors import SettingsError
from omni_local.protocol.messages import Message
from device_under_test import TEST_DEVICE
from replies import send

REPLY = [104, 199, 335, 246, 335, 483]  # tokens decoded after the prompt (any ids do)


@pytest.fixture(scope="module")
def deterministic_apps(demo_settings, make_apps):
    """The model with the deterministic setting and speech, twice: every cache on, every cache off."""
    return make_apps(demo_settings.replace(deterministic=True, speech=True, max_speech_seconds=1.0))


def question(runner) -> Prompt:
    """A question with a picture (so DeepStack's rows are in it), followed by REPLY's tokens: one
    prompt, whose last len(REPLY) tokens a decode step may compute instead."""
    picture = Image.new("RGB", (64, 48), (200, 120, 30))
    prompt = build_prompt([Message("user", [picture, "What is in this picture?"])], runner.encoder.processor)
    reply = torch.tensor([REPLY])
    return replace(prompt, input_ids=torch.cat([prompt.input_ids, reply], dim=1),
                   keys=np.concatenate([prompt.keys, reply[0].numpy()]))


def computed(runner, prompt: Prompt, parts: list[int], decoded: int, beside: int = 0) -> dict[str, torch.Tensor]:
    """The prompt's rows computed into fresh blocks as prefill parts ending at each of `parts`, then
    its last `decoded` tokens as decode steps, each step `beside` other sequences' too (on a GPU, one
    graphed batch): every layer's keys and values of its rows, the Talker's rows, and the logits
    after its last token."""
    tables = [runner.kv.take(runner.kv.shape.table_blocks) for _ in range(1 + beside)]
    try:
        end = prompt.num_tokens - decoded
        prepared = runner.prepare(prompt, 0, remember=False)
        for other in tables[1:]:  # another chat's first rows: the prompt's first 5 tokens
            runner.prefill(other, prepared.rows(0, 5))
        begin = 0
        for part_end in [*parts, end]:
            logits = runner.prefill(tables[0], prepared.rows(begin, part_end))
            begin = part_end
        for step, index in enumerate(range(end, prompt.num_tokens)):
            tokens = [int(prompt.input_ids[0, index]), *REPLY[:beside]]
            logits = runner.decode(tables, tokens, [index, *[5 + step] * beside], [prepared.rope_delta] * len(tables))[0]
        device_table = runner.kv.device_table(tables[0])[None]
        rows = {"logits": logits}
        for layer, (keys, values) in enumerate(zip(runner.kv.keys, runner.kv.values)):
            rows[f"layer {layer} keys"] = gathered(keys, device_table)[:, :, : prompt.num_tokens]
            rows[f"layer {layer} values"] = gathered(values, device_table)[:, :, : prompt.num_tokens]
        if runner.kv.talker_rows is not None:  # made by prefills only (a reply's tokens have none): the question's
            question_rows = torch.arange(prompt.num_tokens - len(REPLY))
            rows["talker rows"] = runner.kv.read_talker_rows(tables[0], question_rows)
        return rows
    finally:
        for table in tables:
            runner.kv.pool.release(table)


def every_way(runner) -> dict[str, dict[str, torch.Tensor]]:
    prompt = question(runner)
    end = prompt.num_tokens
    return {
        "one prefill": computed(runner, prompt, [], 0),
        "a prefill, then decode steps": computed(runner, prompt, [], len(REPLY)),
        "a prefill, then decode steps beside two other chats": computed(runner, prompt, [], len(REPLY), beside=2),
        "a tail after 9 cached rows, then decode steps": computed(runner, prompt, [9], 2),
        "a tail after all but 3 rows": computed(runner, prompt, [end - 3], 0),
        "chunks of 16 rows": computed(runner, prompt, list(range(16, end, 16)), 0),
    }


def differing(ways: dict[str, dict[str, torch.Tensor]]) -> list[str]:
    (_, reference), *others = ways.items()
    return [f"{way}: {name}" for way, rows in others for name, tensor in rows.items()
            if not torch.equal(tensor, reference[name])]


@torch.inference_mode()
def test_a_tokens_rows_and_the_next_logits_are_the_same_bits_however_its_prompt_was_computed(deterministic_apps):
    cached, _ = deterministic_apps
    runner = cached.backend.engine.runner

    assert differing(every_way(runner)) == []


@torch.inference_mode()
def test_so_they_are_with_int4_weights(demo_settings, demo_checkpoint):
    # int4's experts through the MoE kernels, its int8 attention and lm_head through the GEMV
    from omni_local.api import OmniLocal

    with OmniLocal(demo_settings.replace(deterministic=True, weights="int4")) as app:
        assert differing(every_way(app.backend.engine.runner)) == []
        assert app.backend.info.describe().endswith(f"float32 on {app.backend.engine.runner.device}, int4 weights,"
                                                    " deterministic · speech off")  # the header


@torch.inference_mode()
def test_the_invariant_kernels_give_a_row_the_same_bits_alone_and_among_others(deterministic_apps):
    # The swapped model's RMSNorm, Linears (the fused q, k and v; lm_head) and MoE block, a row at a
    # time against 23 rows at once; each close to its default form (transformers', the library's).
    from omni_local.engine.forward.moe.triton_backend import TritonMoe

    model = deterministic_apps[0].backend.loaded.model
    layer = model.thinker.model.language_model.layers[0]
    weight = layer.input_layernorm.weight
    hidden = torch.randn((23, weight.shape[0]), generator=torch.Generator().manual_seed(3)).to(weight.device)
    invariant = TritonMoe(batch_invariant=True)
    parts = {"RMSNorm": layer.input_layernorm, "q, k and v": layer.self_attn.qkv_proj, "lm_head": model.thinker.lm_head,
             "MoE block": lambda x: invariant.routed_experts(layer.mlp, x)}
    transformers_norm = next(c for c in type(layer.input_layernorm).__mro__ if c.__module__.startswith("transformers"))
    defaults = {"RMSNorm": lambda x: transformers_norm.forward(layer.input_layernorm, x),
                "q, k and v": lambda x: torch.nn.functional.linear(x, layer.self_attn.qkv_proj.weight),
                "lm_head": lambda x: torch.nn.functional.linear(x, model.thinker.lm_head.weight),
                "MoE block": lambda x: TritonMoe().routed_experts(layer.mlp, x)}

    for name, part in parts.items():
        together = part(hidden)
        alone = torch.cat([part(hidden[i : i + 1]) for i in range(len(hidden))])
        assert torch.equal(alone, together), name
        torch.testing.assert_close(together, defaults[name](hidden), rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's CPU import
@torch.inference_mode()
def test_compiled_layers_around_the_invariant_kernels_keep_a_rows_bits_whatever_the_forward(deterministic_apps):
    # On a GPU the layers' work around our kernels runs compiled (inductor fuses the row-wise rest):
    # fused whole, a prefill of 9 tokens and a prefill of 5 then 4 decode steps write the same rows.
    from omni_local.engine.forward.decoder_stack import LayerRegions, run_layers
    from omni_local.engine.memory.kv_store import KVShape, KVStore
    from omni_local.engine.forward.moe.triton_backend import TritonMoe

    app = deterministic_apps[0]
    stack = app.backend.loaded.model.thinker.model.language_model
    kernel = app.backend.engine.runner.attention.prefill
    config, weight = stack.config, stack.norm.weight
    shape = KVShape(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, max_tokens=32)
    regions = LayerRegions(compiled=True, moe=TritonMoe(batch_invariant=True))
    embeds = torch.randn((1, 9, config.hidden_size), generator=torch.Generator().manual_seed(5)).to(weight)
    positions = torch.arange(9, device=weight.device)[None].expand(3, 1, -1)
    rows, last = [], []
    for parts in ([9], [5, 1, 1, 1, 1]):
        store = KVStore(shape, shape.table_blocks + 1, weight.dtype, weight.device)
        table, start = store.take(shape.table_blocks), 0
        for length in parts:
            end = start + length
            out, _ = run_layers(stack, store.writer(table, start, kernel), embeds[:, start:end],
                                positions[:, :, start:end], regions=regions)
            start = end
        rows.append(store.to_host(table, 9).kv)
        last.append(out)
    assert torch.equal(rows[0], rows[1]) and torch.equal(last[0], last[1])


def test_the_invariant_ops_pass_torch_librarys_checks_of_their_fakes_and_schemas():
    import omni_local.kernels.rms_norm  # noqa: F401 (registers the op)

    rows = torch.randn((3, 40), generator=torch.Generator().manual_seed(4)).to(TEST_DEVICE)
    torch.library.opcheck(torch.ops.omni_local.rms_norm.default, (rows, torch.rand(40, device=TEST_DEVICE), 1e-6))


# The norm as the engine launches it at the Thinker's width and at a head's (q_norm, k_norm).
COMPILE_RMS_NORM_FOR_SM90 = """
from omni_local.kernels.rms_norm import _rms_norm_kernel

for width in (2048, 128):
    compiled(_rms_norm_kernel, dict(x_ptr="*bf16", weight_ptr="*bf16", out_ptr="*bf16", eps="fp32"),
             dict(BLOCK=width), num_warps=4, enable_fp_fusion=False)
"""


def test_the_norm_compiles_for_an_h200_without_a_gpu():
    from compile_for_h200 import compile_for_h200

    done = compile_for_h200(COMPILE_RMS_NORM_FOR_SM90)

    assert done.returncode == 0, done.stderr


def test_the_caches_change_no_reply_text_image_or_spoken(deterministic_apps):
    picture = Image.new("RGB", (40, 56), (10, 160, 90))
    replies = []
    for app in deterministic_apps:  # every cache on, then every cache off
        session = app.session()
        replies.append([send(app, session, "Name a colour.", max_new_tokens=8),
                        send(app, session, "And this one?", images=[picture], max_new_tokens=8),
                        send(app, session, "Say it again.", max_new_tokens=8)])

    for turn, (cached, uncached) in enumerate(zip(*replies)):
        (finished, frames, _, _), (finished_cold, frames_cold, _, _) = cached, uncached
        assert finished.token_ids == finished_cold.token_ids, turn
        assert frames == frames_cold and frames, turn  # each reply spoken, its codes the same
    assert replies[0][2][0].tokens.reused_gpu > 0  # the last turn reused the earlier turns' rows


def test_the_setting_refuses_the_torch_backends():
    from omni_local.settings import Settings

    for backend in ("moe_backend", "attention_backend"):
        with pytest.raises(SettingsError, match=f"'deterministic' runs our Triton kernels, and '{backend}'"):
            Settings(deterministic=True, **{backend: "torch"})
