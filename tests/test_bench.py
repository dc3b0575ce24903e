"""The benchmark runs end to end on the demo model and writes its table and JSON."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_the_bench_smoke_run_writes_every_row_and_the_cache_rows_compute_less(demo_settings, demo_checkpoint, tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "omni_local.bench", "--runs", "1", "--new-tokens", "2", "--json", str(out),
         "--demo-dir", str(demo_settings.demo_path), "--cache-dir", str(tmp_path / "cache"), "--device", "cpu",
         "--gpu-cache-bytes", str(64 << 20), "--max-context-tokens", "4096", "--max-prompt-tokens", "3960",
         "--speech", "true", "--max-speech-seconds", "0.5"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr
    header = "| scenario | prompt tokens | system | computed | TTFT (ms) | ITL (ms) | first audio (ms) | RTF | audio (s) |"
    assert header in done.stdout
    rows = {(r["scenario"], r["system"]): r for r in json.loads(out.read_text())["rows"]}
    assert len(rows) == 20
    for scenario in ("same image 480x640, new question", "same video 10 s, new question", "text chat turn 2",
                     "voice chat turn 2"):
        on, off = rows[scenario, "omni_local, cache on"], rows[scenario, "omni_local, cache off"]
        assert on["computed"] < off["computed"] == off["prompt"]
    for system in ("omni_local, cache off", "transformers"):
        spoken = rows["spoken reply, first send", system]
        assert spoken["audio_s"] > 0 and spoken["first_audio_ms"] > 0 and spoken["rtf"] > 0
