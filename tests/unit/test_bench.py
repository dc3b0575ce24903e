"""The benchmark runs end to end on the demo model and writes its table and JSON."""

import gzip
import json
import math
import os
import re
import statistics
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer
from transformers.utils import is_torchvision_available

from omni_local.bench.__main__ import chosen_scenarios, median_of
from omni_local.bench.beside import longest_gap
from omni_local.bench.compile_log import compile_log
from omni_local.bench.decode_steps import chat_contexts, chat_tokens, decode_step, held_tables
from omni_local.bench.profile_decode import (
    ATTENTION, CATEGORIES, DENSE, ELEMENTWISE, EXPERTS, KV, OTHER, ROUTING, category,
)
from omni_local.bench.profile_turn import busy_ms, longest_read_gap, within
from omni_local.bench.scenarios import QUESTION, SYSTEM, Scenario, noise_image, question, scenarios
from omni_local.engine.phases import (BEGIN_SPEECH, BUILD_PROMPT, CLAIM_KV, COLLECT, DECODE, ENCODE_MEDIA, FIRST_TOKEN,
                                      PREFILL, PREPARE, SPEECH_FRAME, phase)
from omni_local.engine.prompt.builder import build_prompt
from omni_local.protocol.messages import Message

REPO = Path(__file__).resolve().parents[2]
CACHE_ON, CACHE_OFF = "omni_local, cache on", "omni_local, cache off"
EVERY = (CACHE_ON, CACHE_OFF, "transformers")
FIRST_SEND = (CACHE_OFF, "transformers")  # nothing to reuse, so no cache-on row
CONCURRENT = (CACHE_ON, CACHE_OFF, "transformers, sequential")
SIZES = ("224x224", "480x640", "1200x1600")
EXPECTED = {  # scenario -> the systems that time it
    "text, first send": FIRST_SEND,
    **{f"image {size}, first send": FIRST_SEND for size in SIZES},
    **{f"same image {size}, new question": EVERY for size in SIZES},
    **{f"image chat {size} turn 2": EVERY for size in SIZES[1:]},
    "same audio 10 s, new question": EVERY,
    "text chat turn 2": EVERY,
    "text chat turn 2, c8": CONCURRENT,
    "text chat turn 2, c16": CONCURRENT,
    "text, first send, c16": (CACHE_OFF, "transformers, sequential"),
    "32 chats of about 1,000 tokens, in turn": (CACHE_ON,),  # how their KV is kept: nothing to show without a cache
    "shared 2,084-token system prompt, new question": EVERY,
    "2,084-token system prompt, first send": FIRST_SEND,
    "470-token system prompt (one chunk), first send": FIRST_SEND,
    "2,084-token system prompt, first send beside a decoding chat": (CACHE_OFF,),  # transformers does one at a time
    "first image 480x640 after restart": EVERY,
    # The bench leaves video out where torchvision is missing, as the app refuses it there.
    **({"video 10 s, first send": FIRST_SEND, "same video 10 s, new question": EVERY}
       if is_torchvision_available() else {}),
    "spoken reply, first send": FIRST_SEND,
    "voice chat turn 2": EVERY,
}


def test_the_bench_smoke_run_times_every_scenario_and_the_cache_rows_compute_only_what_is_new(
    demo_settings, demo_checkpoint, tmp_path
):
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "omni_local.bench", "--runs", "1", "--new-tokens", "3", "--json", str(out),
         "--reading-seconds", "0",
         "--demo-dir", str(demo_settings.demo_path), "--cache-dir", str(tmp_path / "cache"), "--device", "cpu",
         # Blocks for all 16 concurrent chats at once (the demo's 2 KiB per token x 4,096 tokens each).
         "--gpu-cache-bytes", str(256 << 20), "--max-context-tokens", "4096", "--max-prompt-tokens", "3960",
         "--speech", "true", "--max-speech-seconds", "0.5"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert "wait for a seat" not in done.stderr  # every concurrent chat ran at once
    header = ("| scenario | prompt tokens | system | computed | TTFT (ms) | ITL (ms) | start-up (ms) "
              "| first audio (ms) | RTF | audio (s) | other chat's longest gap (ms) | queue wait p95 (ms) |")
    assert header in done.stdout
    rows = {(r["scenario"], r["system"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {(scenario, system) for scenario, systems in EXPECTED.items() for system in systems}
    for (scenario, system), row in rows.items():
        assert 0 < row["computed"] <= row["prompt"], (scenario, system)
        times = {k: v for k, v in row.items() if k.endswith(("_ms", "_s")) or k == "rtf"}
        if system == "transformers" and "rtf" in row:
            del times["ttft_ms"], times["itl_ms"]  # generate(return_audio=True) streams no tokens
        assert all(v > 0 for v in times.values()), (scenario, system, times)  # NaN fails too
        assert ("start_up_ms" in row) == ("restart" in scenario and system in (CACHE_ON, CACHE_OFF)), (scenario, system)
        assert ("other_gap_ms" in row) == ("beside" in scenario), (scenario, system)

    def on_off(scenario: str) -> tuple[dict, dict]:
        return rows[scenario, CACHE_ON], rows[scenario, CACHE_OFF]

    # A restarted app has no KV yet: only the rows in one app reuse a prefix.
    for scenario in [s for s, systems in EXPECTED.items() if {CACHE_ON, CACHE_OFF} <= set(systems) and "restart" not in s]:
        on, off = on_off(scenario)
        assert on["computed"] < off["computed"] == off["prompt"] == on["prompt"], scenario
    # After a restart the image's encoder output comes from the disk cache; without the cache it is encoded.
    assert [row["media_encoded"] for row in on_off("first image 480x640 after restart")] == [0, 1]
    # Each chat of a turn 2 computes its new question only, alone or with 7 or 15 others, each asking its
    # own (give or take the end of its first reply, whose last token was never fed back).
    alone = on_off("text chat turn 2")[0]["computed"]
    tokenizer = AutoTokenizer.from_pretrained(demo_checkpoint)
    scenario = {s.name: s for s in scenarios(tokenizer)}["text chat turn 2, c16"]
    own = [len(tokenizer.encode(question(scenario, 0, chat).text)) for chat in range(16)]
    for n in (8, 16):
        expected = statistics.median(alone + length - own[0] for length in own[:n])
        assert abs(on_off(f"text chat turn 2, c{n}")[0]["computed"] - expected) <= 2, n
    # The resent system prompt's 2,084 tokens come from the other session; only the short question is new.
    on, off = on_off("shared 2,084-token system prompt, new question")
    assert on["computed"] <= off["prompt"] - 2084 < 60
    # 32 chats of about 1,000 tokens, taken up in turn: each one's KV is still there, only its question is new.
    in_turn = rows["32 chats of about 1,000 tokens, in turn", CACHE_ON]
    assert 900 < in_turn["prompt"] < 1150 and in_turn["computed"] < 60 and "queue_p95_ms" in in_turn
    first_sends = [rows[f"image {size}, first send", CACHE_OFF]["prompt"] for size in SIZES]
    assert first_sends == sorted(first_sends)
    # Time to first audio and real-time factor, cold and on a cached turn (their values checked above).
    spoken = ("spoken reply, first send", "voice chat turn 2")
    assert all("rtf" in rows[scenario, system] for scenario in spoken for system in EXPECTED[scenario])


def run_part_bench(module: str, demo_settings, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`python -m omni_local.bench.<module> *args` on the demo model on the CPU, with KV for 32 chats
    of 1,024 tokens (settings in `args` come later, and win)."""
    return subprocess.run(
        [sys.executable, "-m", f"omni_local.bench.{module}", "--device", "cpu",
         "--demo-dir", str(demo_settings.demo_path), "--cache-dir", str(tmp_path / "cache"),
         "--gpu-cache-bytes", str(64 << 20), "--max-context-tokens", "1024", "--max-prompt-tokens", "960", *args],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )


def test_only_picks_the_scenarios_whose_names_hold_its_texts_or_with_exact_equal_them():
    from omni_local.bench.scenarios import Scenario

    scenarios = [Scenario(name, "", [], None) for name in ("text, first send", "text, first send, c16", "video")]
    names = lambda only, exact: [s.name for s in chosen_scenarios(scenarios, only, exact)]  # noqa: E731

    assert names(["text, first send"], False) == ["text, first send", "text, first send, c16"]
    assert names(["text, first send"], True) == ["text, first send"]
    assert names([], True) == [s.name for s in scenarios]


def test_a_row_times_its_runs_after_one_warm_up_run_unless_told_to_time_the_first_use():
    seen = []

    def measure(run: int) -> dict[str, float]:
        seen.append(run)
        return {"ttft_ms": 10.0 * (run + 2)}

    assert median_of(2, measure) == {"ttft_ms": 25.0} and seen == [-1, 0, 1]
    seen.clear()
    assert median_of(1, measure, warm_up=False) == {"ttft_ms": 20.0} and seen == [0]


@pytest.mark.parametrize("timing", [[], ["--queued"]], ids=["each step alone", "steps queued back to back"])
def test_the_decode_step_bench_smoke_run_prints_a_step_time_for_each_batch_and_context(
    demo_settings, demo_checkpoint, tmp_path, timing
):
    done = run_part_bench("decode_steps", demo_settings, tmp_path, "--runs", "1", *timing)
    assert done.returncode == 0, done.stderr
    assert ("queued back to back" in done.stdout) == bool(timing)
    table = [line for line in done.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [line.split(" | ")[0] for line in table] == ["| 1", "| 2", "| 4", "| 8", "| 16"][: len(table)]
    assert len(table) >= 2 and all(float(cell) > 0 for line in table for cell in line.strip("| ").split(" | ")[1:])


def test_the_speech_steps_bench_smoke_run_times_each_part_of_a_frame_for_each_number_of_replies(
        demo_settings, demo_checkpoint, tmp_path):
    done = run_part_bench("speech_steps", demo_settings, tmp_path, "--runs", "1", "--replies", "1", "3")
    assert done.returncode == 0, done.stderr
    table = [line.strip("| ").split(" | ") for line in done.stdout.splitlines() if line.startswith("| ")
             and line[2].isdigit()]
    assert [row[0] for row in table] == ["1", "3"]
    assert all(float(cell) > 0 for row in table for cell in row[1:])


def test_each_chat_of_a_decode_step_bench_row_decodes_its_own_token_at_its_own_row(app):
    runner = app.backend.engine.runner
    vocab = runner.model.get_input_embeddings().num_embeddings
    assert chat_contexts(1, 256) == [256], "one chat decodes at the column's row"
    contexts, tokens = chat_contexts(16, 256), chat_tokens(16, vocab)
    assert len(set(contexts)) == 16 and min(contexts) == 224 and max(contexts) == 288
    assert len(set(tokens)) == 16 and all(0 <= t < vocab for t in tokens)
    with held_tables(runner.kv, contexts[:4]) as tables:
        logits = decode_step(runner, tables, contexts[:4])()
    assert all(not torch.equal(logits[i], logits[j]) for i in range(4) for j in range(i + 1, 4))


def test_every_chat_of_a_concurrent_scenario_computes_a_prompt_of_its_own(app):
    processor = app.backend.loaded.processor
    concurrent = [s for s in scenarios(processor.tokenizer) if s.concurrency > 1]
    assert concurrent, "the bench has concurrent rows"
    for scenario in concurrent:
        prompts = [tuple(build_prompt([Message("system", [scenario.system]), question(scenario, 0, chat)],
                                      processor).input_ids[0].tolist()) for chat in range(scenario.concurrency)]
        assert len(set(prompts)) == scenario.concurrency, scenario.name


def test_the_other_chats_of_a_concurrent_image_row_ask_about_images_of_their_own():
    scenario = Scenario("image c2", SYSTEM, [], Message("user", [noise_image((32, 48)), QUESTION]), concurrency=2)
    first, second = (question(scenario, 0, chat) for chat in range(2))
    assert first.text != second.text
    assert first.images()[0].size == second.images()[0].size == (48, 32)
    assert first.images()[0].tobytes() != second.images()[0].tobytes()


@pytest.mark.parametrize("weights", ["bf16", "int4"])
def test_the_card_size_bench_smoke_run_prints_a_row_of_memory_and_times_for_a_spoken_and_a_multimedia_reply(
    demo_settings, demo_checkpoint, tmp_path, weights
):
    done = run_part_bench("card_sizes", demo_settings, tmp_path, "--runs", "1", "--new-tokens", "8", "--weights",
                          weights, "--speech", "true", "--max-speech-seconds", "1")
    assert done.returncode == 0, done.stderr
    row = next(line for line in done.stdout.splitlines() if line.startswith(f"| {weights} |"))
    cells = row.strip("| ").split(" | ")
    assert cells[:3] == [weights, "on", "-"] and len(cells) == 14
    assert cells[4:7] == ["none", "0", "-"]  # no experts in host memory, nothing over the bus
    assert all(float(cell) > 0 for cell in cells[10:])  # TTFT, first audio, RTF, decode step


def test_the_card_size_bench_with_the_memory_plan_prints_its_refusal_as_the_row_where_the_card_is_too_small(
    demo_settings, demo_checkpoint, tmp_path
):
    done = run_part_bench("card_sizes", demo_settings, tmp_path, "--runs", "1", "--weights", "int4", "--card-gib",
                          "1.5", "--plan")
    assert done.returncode == 1
    row = next(line for line in done.stdout.splitlines() if line.startswith("| int4 |"))
    assert "| refused by the memory plan: the model needs " in row and " is free: " in row


def test_a_full_size_checkpoint_leaves_the_tensors_its_format_quantizes_as_holes_and_starts_from_them_then_its_store(
    demo_settings, demo_checkpoint, tmp_path
):
    from safetensors import safe_open

    from omni_local.bench.full_size_checkpoint import write_full_size_checkpoint

    # The demo's own config stands for the full-size one: the same names, at the demo's size.
    folder = tmp_path / "checkpoint"
    sizes = write_full_size_checkpoint(demo_checkpoint / "config.json", folder, "int4", demo=demo_checkpoint)

    shards = sorted(folder.glob("model-*.safetensors"))
    assert sum(shard.stat().st_size for shard in shards) > sizes["files"] > sizes["written"] > 0
    with safe_open(shards[0], "pt") as shard:
        expert = shard.get_tensor("thinker.model.language_model.layers.0.mlp.experts.0.gate_proj.weight")
        norm = shard.get_tensor("thinker.model.language_model.layers.0.input_layernorm.weight")
    assert expert.dtype == torch.bfloat16 and not expert.any() and norm.all()
    rows = [run_part_bench("start_up", demo_settings, tmp_path, "--model", str(folder), "--weights", "int4",
                           "--speech", "true") for _ in range(2)]
    assert all(done.returncode == 0 for done in rows), rows[-1].stderr
    cells = [done.stdout.splitlines()[-1].strip("| ").split(" | ") for done in rows]
    assert [row[:3] for row in cells] == [["int4", "on", "quantized on load"], ["int4", "on", "from their store"]]
    assert all(float(cell) > 0 for row in cells for cell in row[3:])
    steps = [[line.split(", ")[0] for line in done.stderr.splitlines() if line.startswith("start-up: ")]
             for done in rows]
    store = "start-up: the quantized layers' store"
    assert [step for step in steps[0] if step.startswith(store)] == [
        f"{store} looked up (the checkpoint's fingerprint) and read", f"{store} written"]
    assert steps[1][:3] == [f"{store} looked up (the checkpoint's fingerprint) and read",
                            "start-up: the model loaded", "start-up: the Thinker's first prefill and decode step"]
    assert "start-up: Code2Wav" in steps[1]


def test_the_encoder_bench_smoke_run_prints_preprocessing_on_the_cpu_and_on_the_device_for_an_image_and_a_video(
    demo_settings, demo_checkpoint, tmp_path
):
    done = run_part_bench("encoders", demo_settings, tmp_path, "--runs", "1", "--preprocessing-only")
    assert done.returncode == 0, done.stderr
    assert "| preprocessing | on the CPU, then copied (ms) | on cpu (ms) |" in done.stdout
    table = {line.split(" | ")[0][2:]: line.strip("| ").split(" | ")[1:] for line in done.stdout.splitlines()
             if line.startswith(("| image", "| video"))}
    videos = ["video 10 s, 20 frames of 360x640"] if is_torchvision_available() else []
    assert list(table) == ["image 1200x1600", *videos]
    assert all(len(cells) == 2 and all(float(cell) > 0 for cell in cells) for cells in table.values())


def test_the_longest_gap_beside_a_prefill_counts_the_gaps_across_its_edges_and_needs_the_stream_around_it():
    arrivals = [0.0, 1.0, 4.0, 4.5, 9.0]
    assert longest_gap(arrivals, start=2.0, end=4.2) == 3.0  # 1 to 4 holds the start
    assert longest_gap(arrivals, start=4.1, end=4.6) == 4.5  # 4.5 to 9 holds the end
    assert math.isnan(longest_gap(arrivals, start=2.0, end=9.5)), "the stream ended before the prefill did"
    assert math.isnan(longest_gap(arrivals[2:], start=2.0, end=4.2)), "the stream began after the prefill did"


def test_the_decode_step_bench_runs_the_moe_backend_and_the_rows_and_columns_asked_for(
    demo_settings, demo_checkpoint, tmp_path
):
    # The triton backend on the CPU runs in Triton's interpreter: conftest.py sets it for this
    # process, and the bench inherits it.
    done = run_part_bench("decode_steps", demo_settings, tmp_path, "--runs", "1", "--moe-backend", "triton",
                          "--chats", "1", "2", "--contexts", "256")
    assert done.returncode == 0, done.stderr
    assert "MoE backend triton" in done.stdout
    assert "| chats | context 256 |" in done.stdout
    table = [line for line in done.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [line.split(" | ")[0] for line in table] == ["| 1", "| 2"]


def test_the_decode_profile_smoke_run_prints_every_category_and_their_times_add_up_to_the_total(
    demo_settings, demo_checkpoint, tmp_path
):
    done = run_part_bench("profile_decode", demo_settings, tmp_path, "--runs", "2", "--chats", "1", "--context", "64")
    assert done.returncode == 0, done.stderr
    assert "(eager, MoE backend torch), 1 distinct chats at about 64 rows of context" in done.stdout
    assert "| category | kernels per step | ms per step | share |" in done.stdout
    rows = [line.strip("| ").split(" | ") for line in done.stdout.splitlines()
            if line.startswith("| ") and not line.startswith(("| category", "| ---"))]
    assert [row[0] for row in rows] == [*CATEGORIES, "total"]
    *categories, (_, kernels, ms, share) = rows
    assert float(ms) > 0 and share == "100.0%"
    assert abs(sum(float(row[2]) for row in categories) - float(ms)) <= 0.001 * len(categories)  # each cell rounded
    assert sum(float(row[1]) for row in categories) == float(kernels)
    assert float(dict((row[0], row[2]) for row in categories)[DENSE]) > 0  # the projections and lm_head ran
    assert "Wall time per step, unprofiled, median of 2: eager " in done.stdout


def test_the_decode_profile_puts_each_backends_kernels_and_the_compiled_layers_fusions_in_their_category():
    names = {
        "_gate_up_kernel": EXPERTS, "_down_kernel": EXPERTS,  # the triton backend's experts
        "_gate_up_pairs_kernel": EXPERTS, "_down_pairs_kernel": EXPERTS,  # quantized, by pair
        "void cutlass::device_kernel<GemmUniversal<cutlass::gemm::GroupProblemShape<cute::tuple<int, int, int>>>>":
            EXPERTS,  # torch._grouped_mm
        "aten::_grouped_mm": EXPERTS,
        "_route_kernel": ROUTING, "_sort_kernel": ROUTING,
        "void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>": ROUTING,
        "void at::native::bitonicSortKVInPlace<-2, -1, 16, 16, long, long>": ROUTING,
        "void at::native::kernelHistogram1D<float, int, long, 1, 2, -1>": ROUTING,
        "void at::native::index_put_with_sort_kernel<float>": KV,  # the cache write, whatever its name holds
        "void at::native::indexSelectSmallIndex<c10::BFloat16, long, unsigned int, 2, 2, -2>": KV,
        "Memcpy DtoD (Device -> Device)": KV,
        "triton_poi_fused__to_copy_add_mul_0": ELEMENTWISE,  # inductor's fusion, not a copy
        "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1": ELEMENTWISE,
        "fmha_cutlassF_bf16_aligned_64x128_rf_sm80": ATTENTION,
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64_4x1x1": ATTENTION,
        "nvjet_tst_64x8_64x16_4x1_v_bz_TNT": DENSE, "void gemv2T_kernel_val<int, int, __nv_bfloat16>": DENSE,
        "aten::addmm": DENSE,
        "_gemv_kernel": DENSE, "omni_local::quantized_gemv": DENSE,  # our GEMV
        "aten::expand": OTHER, "aten::div_": ELEMENTWISE,
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>": ELEMENTWISE,
    }
    assert {name: category(name) for name in names} == names


def test_the_turn_profile_shows_each_engine_phase_of_a_spoken_first_send_once_and_the_ops_it_ran(
    demo_settings, demo_checkpoint, tmp_path
):
    done = run_part_bench("profile_turn", demo_settings, tmp_path, "--runs", "1", "--reading-seconds", "0",
                          "--only", "spoken reply, first send", "--speech", "true", "--max-speech-seconds", "0.5")
    assert done.returncode == 0, done.stderr
    heading = "## 'spoken reply, first send': where the time to first audio goes\n\nMedians of 1 profiled runs"
    assert heading in done.stdout
    first_audio = re.search(r"Time to first audio: ([\d.]+) ms unprofiled, ([\d.]+) ms profiled\.", done.stdout)
    assert first_audio and float(first_audio[1]) > 0 and float(first_audio[2]) > 0
    tables = {table[0][0]: {row[0]: row[1:] for row in table[2:]} for table in markdown_tables(done.stdout)}
    phases = {name: float(calls) for name, (calls, _) in tables["engine phase"].items()}
    once = [BUILD_PROMPT, CLAIM_KV, PREPARE, ENCODE_MEDIA, FIRST_TOKEN, BEGIN_SPEECH]
    assert {name: phases.get(name) for name in once} == dict.fromkeys(once, 1.0)
    assert phases[PREFILL] >= 1 and phases[SPEECH_FRAME] >= 1  # the first audio needs a frame at least
    ops = tables["device work"]
    assert set(ops) <= set(CATEGORIES) and float(ops[DENSE][1]) > 0


def test_the_turn_profile_of_a_first_use_profiles_the_first_run_since_start_up_alone(
    demo_settings, demo_checkpoint, tmp_path
):
    done = run_part_bench("profile_turn", demo_settings, tmp_path, "--reading-seconds", "0", "--first-use",
                          "--only", "text, first send")
    assert done.returncode == 0, done.stderr
    assert "## 'text, first send': where the time to first token goes\n\nIts first run since start-up, profiled" \
        in done.stdout
    phases = {row[0]: float(row[1]) for table in markdown_tables(done.stdout) if table[0][0] == "engine phase"
              for row in table[2:]}
    assert phases[BUILD_PROMPT] == 1 and phases[PREFILL] == 1  # one run, not a median of several
    # on the CPU the engine compiles nothing (no compiled layers, no graphs, no Triton)
    assert "Compiled or captured from the send to the reply's end:\n- run 0: nothing compiled or captured" \
        in done.stdout


def test_the_compile_log_counts_what_dynamo_compiles_inside_it_and_nothing_from_before():
    doubled = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    doubled(torch.ones(3))
    with compile_log() as log:
        doubled(torch.ones(3))  # compiled before: nothing new
    assert log.dynamo_compiles == 0 and log.summary() == "nothing compiled or captured"
    with compile_log() as log:
        doubled(torch.ones(5))  # a new shape: compiled again
    assert log.dynamo_compiles == 1 and log.summary().startswith("dynamo compiled 1 graph(s) in ")


def test_the_turn_profile_beside_a_decoding_chat_shows_what_filled_its_longest_wait_for_a_token(
    demo_settings, demo_checkpoint, tmp_path
):
    # The 2,084-token prompt, every cache off (a first send), in chunks of 512 while the other chat
    # decodes; the part bench's settings allow prompts of 960 tokens, these later ones 3,960.
    done = run_part_bench("profile_turn", demo_settings, tmp_path, "--runs", "1", "--reading-seconds", "0",
                          "--only", "first send beside", "--max-context-tokens", "4096", "--max-prompt-tokens", "3960",
                          "--trace", str(tmp_path / "traces"))
    assert done.returncode == 0, done.stderr
    trace_file = tmp_path / "traces" / "2-084-token-system-prompt-first-send-beside-a-decoding-chat.json.gz"
    trace = json.loads(gzip.decompress(trace_file.read_bytes()))
    assert PREFILL in {event.get("name") for event in trace["traceEvents"]}  # the engine's thread is in it
    phases = {row[0]: float(row[1]) for table in markdown_tables(done.stdout) if table[0][0] == "engine phase"
              for row in table[2:]}
    assert "caches off" in done.stdout and phases[PREFILL] == 5  # 2,115 tokens: four chunks of 512, and the rest
    gap = re.search(r"- run 0: ([\d.]+) ms: (.*)", done.stdout)
    # One chunk and one decode step in the longest gap, as the engine takes turns
    assert gap and float(gap[1]) > 0 and "prefill forward 1x" in gap[2] and "queue decode step 1x" in gap[2]


def markdown_tables(text: str) -> list[list[list[str]]]:
    """Each markdown table in `text`: its rows, each a list of cells (the header and --- rows included)."""
    tables, rows = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("| "):
            rows.append(line.strip("| ").split(" | "))
        elif rows:
            tables.append(rows)
            rows = []
    return tables


def test_the_devices_busy_time_counts_overlapping_kernels_once():
    assert busy_ms([("a", 0.0, 1000.0), ("b", 500.0, 1500.0), ("c", 3000.0, 3500.0), ("d", 3100.0, 3200.0)]) == 2.0


def test_the_longest_gap_is_between_the_ends_of_two_consecutive_reads_and_holds_what_ran_in_it():
    phases = [(COLLECT, 0.0, 100.0), (PREFILL, 150.0, 4000.0), (DECODE, 4000.0, 4400.0), (COLLECT, 4400.0, 4500.0),
              (COLLECT, 5000.0, 5100.0)]
    assert longest_read_gap(phases) == (100.0, 4500.0)
    assert within(phases, 100.0, 4500.0) == [(PREFILL, 150.0, 4000.0), (DECODE, 4000.0, 4400.0),
                                             (COLLECT, 4400.0, 4500.0)]
    assert longest_read_gap(phases[:1]) is None
    # Gaps that begin after the timed reply's first token are not its doing.
    later = [(COLLECT, 0.0, 100.0), (FIRST_TOKEN, 150.0, 200.0), (COLLECT, 300.0, 400.0), (COLLECT, 9000.0, 9100.0)]
    assert longest_read_gap(later) == (100.0, 400.0)


def test_an_engine_phase_records_nothing_while_no_profiler_runs():
    assert isinstance(phase(PREFILL), nullcontext)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as recorded:
        with phase(PREFILL):
            torch.ones(2).sum()
    assert PREFILL in {event.name for event in recorded.events()}


def test_the_paged_attention_bench_smoke_run_times_each_way_for_each_batch_and_context():
    # On the CPU the kernel runs in Triton's interpreter, on a GPU run too (conftest.py sets it only on the CPU's).
    done = subprocess.run([sys.executable, "-m", "omni_local.bench.paged_attention", "--device", "cpu", "--runs", "1",
                           "--split-rows", "256"], cwd=REPO, env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "| chats | context | slots (µs) | gathered (µs) | paged (µs) | paged, splits of 256+ (µs) |" in done.stdout
    table = [line.strip("| ").split(" | ") for line in done.stdout.splitlines()
             if line.startswith("| ") and line[2].isdigit()]
    assert [row[:2] for row in table] == [["1", "32"], ["1", "272"], ["2", "32"], ["2", "272"]]
    assert all(float(cell) > 0 for row in table for cell in row[2:-1])  # the speed-up may round to 0.00x
    assert all(row[-1].endswith("x") for row in table)


def test_the_dense_projection_bench_smoke_run_times_each_way_for_each_projection_and_row_count():
    # On the CPU the GEMV runs in Triton's interpreter (a GPU run's conftest.py does not set it).
    done = subprocess.run([sys.executable, "-m", "omni_local.bench.dense_projections", "--device", "cpu", "--runs", "1"],
                          cwd=REPO, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    ways = ["linear", "fp8 scaled_mm", "fp8 gemv", "int8 pack_mm", "int8 gemv"]
    assert f"| projection | rows | {' | '.join(f'{way} (µs)' for way in ways)} |" in done.stdout
    assert f"| rows | {' | '.join(ways)} |" in done.stdout
    projections_part, _, routers_part = done.stdout.partition("| router | rows | linear (µs) | gemv (µs) |")
    table = [line.strip("| ").split(" | ") for line in projections_part.splitlines() if line.startswith("| ")
             and line[2].isalnum() and not line.startswith(("| projection", "| rows"))]
    calls, steps = table[:-2], table[-2:]  # each projection's call, then a decode step's 96 of them
    projections = ["qkv_proj 64->192", "o_proj 128->64"]
    assert [row[:2] for row in calls] == [[p, rows] for rows in ("1", "16") for p in projections]
    assert [row[0] for row in steps] == ["1", "16"]
    assert all(len(row) == 2 + len(ways) and all(float(cell) > 0 for cell in row[2:]) for row in calls)
    assert all(len(row) == 1 + len(ways) and all(float(cell) > 0 for cell in row[1:]) for row in steps)
    # Then the router's gate, by F.linear and by the GEMV
    routers = [line.strip("| ").split(" | ") for line in routers_part.splitlines() if line.startswith("| router ")]
    assert [row[:2] for row in routers] == [["router 64->16", rows] for rows in ("1", "16")]
    assert all(len(row) == 4 and all(float(cell) > 0 for cell in row[2:]) for row in routers)


def test_the_determinism_bench_smoke_run_counts_differing_replies_for_each_case(demo_settings, demo_checkpoint,
                                                                                 tmp_path):
    done = run_part_bench("determinism", demo_settings, tmp_path, "--replies", "2", "--new-tokens", "4",
                          "--system-tokens", "300", "--speech", "true", "--max-speech-seconds", "0.5")
    assert done.returncode == 0, done.stderr
    rows = [line.strip("| ").split(" | ") for line in done.stdout.splitlines() if line.startswith("| ")][2:]
    assert [cells[0] for cells in rows] == [
        "same image, new question, cache on against off", "text chat turn 2, cache on against off",
        "shared 300-token system prompt, cache on against off", "spoken reply (text and codes), cache on against off",
        "text chat turn 2, alone against beside 15 chats",
        "text chat turn 2 resumed from host memory (2 of 2 did), cache on against off"]  # each turn 2 did
    assert all(cells[1] == "2" and 0 <= int(cells[2]) <= 2 for cells in rows)


def test_the_determinism_bench_measures_only_the_cases_asked_for(demo_settings, demo_checkpoint, tmp_path):
    # A GPU call's time limit may not fit all six cases: a call measures some.
    done = run_part_bench("determinism", demo_settings, tmp_path, "--replies", "1", "--new-tokens", "4",
                          "--cases", "beside", "text")
    assert done.returncode == 0, done.stderr
    rows = [line.strip("| ").split(" | ") for line in done.stdout.splitlines() if line.startswith("| ")][2:]
    assert [cells[0] for cells in rows] == ["text chat turn 2, cache on against off",
                                            "text chat turn 2, alone against beside 15 chats"]


def test_the_card_size_benchs_largest_request_fills_the_prompt_with_the_processors_largest_images(demo_checkpoint):
    from omni_local.bench.card_sizes import largest_request
    from omni_local.engine.prompt.builder import image_grid
    from omni_local.model.workarounds import load_processor

    processor = load_processor(demo_checkpoint)
    asked, tokens = largest_request(processor, max_prompt_tokens=6144)
    images = asked.images()
    assert len({image.tobytes() for image in images}) == len(images) > 1  # distinct: none is a cache hit
    per_image = math.prod(image_grid(images[0], processor.image_processor)) // 4
    assert tokens == len(images) * per_image <= 6144 - 256 < (len(images) + 1) * per_image


def test_the_realtime_latency_bench_serves_the_demo_itself_and_times_each_spoken_turn(demo_settings, demo_checkpoint,
                                                                                      tmp_path):
    done = run_part_bench("realtime_latency", demo_settings, tmp_path, "--turns", "2", "--max-speech-seconds", "1",
                          "--json", str(tmp_path / "turns.json"))
    assert done.returncode == 0, done.stderr
    turns = json.loads((tmp_path / "turns.json").read_text())["turns"]
    assert len(turns) == 2 and all(turn["server_ms"] > 0 and turn["client_ms"] > 0 for turn in turns)
    assert turns[1]["cached_tokens"] > 0  # the second turn reuses the first, as a realtime session does
    assert "median of turns 2+ |" in done.stdout
