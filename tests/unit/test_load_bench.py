"""The load bench runs end to end on the demo model, through the Python API and through the HTTP
server with the `openai` SDK, and its clients ask questions of their own."""

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from omni_local.bench.load import COLUMNS, percentile, row_figures
from omni_local.bench.load_clients import LoadSpec, Sample, one_token_words, question_text
from omni_local.bench.scenarios import SYSTEM
from omni_local.engine.prompt.builder import build_prompt
from omni_local.model.workarounds import load_processor
from omni_local.protocol.messages import Message

REPO = Path(__file__).resolve().parents[2]
CLIENTS = 2
SPEECH_FIGURES = ("first_audio_p50_ms", "first_audio_p95_ms", "rtf_p50", "rtf_p95")


@pytest.fixture(scope="module")
def smoke_run(demo_settings, demo_checkpoint, tmp_path_factory) -> tuple[str, dict[tuple[str, str], dict]]:
    """A second of 2 clients, for each way in and kind of reply: its stdout, and its rows by
    (through, replies)."""
    root = tmp_path_factory.mktemp("load")
    done = subprocess.run(
        [sys.executable, "-m", "omni_local.bench.load", "--clients", str(CLIENTS), "--seconds", "1",
         "--new-tokens", "4", "--question-tokens", "40", "--json", str(root / "load.json"),
         "--demo-dir", str(demo_settings.demo_path), "--cache-dir", str(root / "cache"), "--device", "cpu",
         "--speech", "true", "--max-speech-seconds", "0.5"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads((root / "load.json").read_text())["rows"]
    return done.stdout, {(row["through"], row["replies"]): row for row in rows}


def test_the_load_bench_prints_a_row_for_each_way_in_and_kind_of_reply_with_every_reply_complete(smoke_run):
    stdout, rows = smoke_run
    assert "| " + " | ".join(COLUMNS) + " |" in stdout
    assert list(rows) == [("api", "text"), ("api", "spoken"), ("http", "text"), ("http", "spoken")]
    for key, row in rows.items():
        assert row["clients"] == CLIENTS and row["incomplete"] == 0, key
        assert row["requests"] >= CLIENTS, key  # each client sends one at least
        shared = ("requests_per_s", "tokens_per_s", "ttft_p50_ms", "ttft_p95_ms", "itl_p50_ms", "itl_p95_ms")
        assert all(row[name] > 0 for name in shared), (key, row)
        assert row["ttft_p50_ms"] <= row["ttft_p95_ms"] and row["itl_p50_ms"] <= row["itl_p95_ms"], key
        assert math.isnan(row["gpu_memory_gib"]), key  # on the CPU: shown as '-'
        begins = f"| {key[0]} | {CLIENTS} | {key[1]} |"
        table_row = next(line for line in stdout.splitlines() if line.startswith(begins))
        assert table_row.endswith(" | - |"), table_row


def test_spoken_rows_report_first_audio_and_real_time_factor_and_text_rows_none(smoke_run):
    _, rows = smoke_run
    for through in ("api", "http"):
        assert all(rows[through, "spoken"][name] > 0 for name in SPEECH_FIGURES), through
        assert all(math.isnan(rows[through, "text"][name]) for name in SPEECH_FIGURES), through


def test_the_http_rows_clients_read_the_engines_own_queue_wait_from_the_servers_stream(smoke_run):
    # The remote backend's openai client finds it only in the `omni_local` figures the server streams.
    _, rows = smoke_run
    assert all(rows["http", replies]["queue_p95_ms"] > 0 for replies in ("text", "spoken"))


def test_the_api_rows_run_where_the_servers_packages_are_not_installed(demo_settings, demo_checkpoint, tmp_path):
    # As on a GPU machine that has torch but not the server's packages: importing them fails.
    missing = ("uvicorn", "starlette", "fastapi", "sse_starlette", "openai", "websockets")
    run = (f"import sys; sys.modules.update(dict.fromkeys({missing!r})); "
           "from omni_local.bench.load import main; main()")
    done = subprocess.run(
        [sys.executable, "-c", run, "--through", "api", "--clients", "1", "--seconds", "0.5", "--new-tokens", "2",
         "--demo-dir", str(demo_settings.demo_path), "--cache-dir", str(tmp_path / "cache"), "--device", "cpu"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert [line[:16] for line in done.stdout.splitlines() if line.startswith("| api ")] == ["| api | 1 | text"]


def test_the_http_rows_stop_at_once_naming_a_server_package_that_does_not_import(demo_settings, tmp_path):
    # Before the model is built: at full size that takes minutes of a GPU machine's time.
    run = "import sys; sys.modules['uvicorn'] = None; from omni_local.bench.load import main; main()"
    done = subprocess.run(
        [sys.executable, "-c", run, "--through", "both", "--clients", "1", "--seconds", "0.5",
         "--demo-dir", str(demo_settings.demo_path), "--cache-dir", str(tmp_path / "cache"), "--device", "cpu"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 1 and "--through http needs 'uvicorn', which does not import here" in done.stderr
    assert "model:" not in done.stdout


def test_each_client_and_each_request_asks_a_question_of_its_own_of_about_the_length_asked(demo_checkpoint):
    processor = load_processor(demo_checkpoint)
    words = one_token_words(processor.tokenizer)
    assert len(words) >= 32
    spec = LoadSpec(row=0, clients=4, seconds=1.0, system=SYSTEM, words=words, question_tokens=100, new_tokens=4,
                    speak=False)
    asked = [question_text(spec, client, number) for client in range(4) for number in range(2)]
    lengths = {len(processor.tokenizer.encode(text, add_special_tokens=False)) for text in asked}
    assert max(lengths) - 100 <= 2 and min(lengths) >= 100, lengths  # the first word may take a token or two more
    prompts = [build_prompt([Message("system", [SYSTEM]), Message("user", [text])], processor).input_ids[0].tolist()
               for text in asked]
    assert len({tuple(ids) for ids in prompts}) == len(asked)
    # Distinct all through, not in a tag alone: any two questions differ in most of their positions.
    questions = [processor.tokenizer.encode(text, add_special_tokens=False)[:100] for text in asked]
    assert all(sum(a != b for a, b in zip(first, second)) > 50
               for i, first in enumerate(questions) for second in questions[i + 1:])
    # Another row asks other questions: nothing it sends is in the prefix cache from an earlier row.
    assert question_text(dataclasses.replace(spec, row=1), 0, 0) != asked[0]


def test_a_row_counts_incomplete_replies_apart_and_leaves_them_out_of_its_figures():
    def sample(ttft_s: float, gaps_s: list[float], complete: bool = True) -> Sample:
        return Sample(complete, generated=len(gaps_s) + 1, ttft_s=ttft_s, gaps_s=gaps_s, queue_wait_s=ttft_s / 2)

    samples = [sample(0.1, [0.01, 0.02]), sample(0.3, [0.03]), sample(9.0, [9.0], complete=False),
               Sample.failed("the server is busy")]
    figures = row_figures(samples, wall_s=2.0)
    assert figures["requests"] == 2 and figures["incomplete"] == 2
    assert figures["requests_per_s"] == 1.0 and figures["tokens_per_s"] == 2.5  # 3 + 2 tokens in 2 s
    assert figures["ttft_p50_ms"] == pytest.approx(100.0) and figures["ttft_p95_ms"] == pytest.approx(300.0)
    assert figures["itl_p50_ms"] == pytest.approx(20.0) and figures["itl_p95_ms"] == pytest.approx(30.0)
    assert figures["queue_p95_ms"] == pytest.approx(150.0)
    assert math.isnan(figures["first_audio_p50_ms"]) and math.isnan(figures["rtf_p95"])  # no speech asked


def test_a_percentile_is_the_nearest_ranked_value_of_those_known():
    assert percentile([4.0, 1.0, 3.0, 2.0, None, math.nan], 0.5) == 2.0  # two of the four are at most 2
    assert percentile([4.0, 1.0, 3.0, 2.0], 0.95) == 4.0 and percentile([4.0, 1.0, 3.0, 2.0], 0.75) == 3.0
    assert math.isnan(percentile([None], 0.5))
