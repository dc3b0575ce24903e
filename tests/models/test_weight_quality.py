"""The weight-quality bench (bench/weight_quality.py) on the demo: a row per format, bf16 against
itself exactly, and the formats in the order of their rounding, which on the demo is far apart; and
the demo's wide variant, whose experts are quantized in int4's real groups of 128."""

import json
import subprocess
import sys
from pathlib import Path

from device_under_test import TEST_DEVICE
from omni_local.bench.weight_quality import BFLOAT16_ROUNDED
from omni_local.model.demo import WIDE, ensure_demo_checkpoint
from omni_local.model.loader import load_model
from omni_local.settings import Settings

REPO = Path(__file__).resolve().parents[2]
NEW_TOKENS = 8
KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "experts")


def test_the_quality_bench_scores_every_format_on_the_same_positions_as_bf16(demo_settings, demo_checkpoint, tmp_path):
    out = tmp_path / "quality.json"
    done = subprocess.run(
        [sys.executable, "-m", "omni_local.bench.weight_quality", "--new-tokens", str(NEW_TOKENS), "--layers",
         "--json", str(out), "--demo-dir", str(demo_settings.demo_path), "--cache-dir", str(tmp_path / "cache"),
         "--device", TEST_DEVICE, "--dtype", "float32"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    rows = {row["weights"]: row for row in result["formats"]}
    assert list(rows) == ["bf16", BFLOAT16_ROUNDED, "fp8", "int4"]
    for row in rows.values():
        assert f"| {row['weights']} | {row['formats']} | {row['positions']} |" in done.stdout
    assert len({row["positions"] for row in rows.values()}) == 1  # every format read the same tokens

    bf16 = rows["bf16"]
    assert bf16["mean_kl"] == 0 and bf16["top1_agreement"] == 1 and bf16["greedy_equal"] == 1
    assert bf16["first_difference_min"] == NEW_TOKENS
    # On the demo each is several times the one before (about 0.0007, 0.065 and 0.17 nats).
    assert 0 < rows[BFLOAT16_ROUNDED]["mean_kl"] < rows["fp8"]["mean_kl"] < rows["int4"]["mean_kl"]
    for weights in ("fp8", "int4"):
        assert rows[weights]["top1_agreement"] < 1

    layers = {(row["weights"], row["layer"]): row for row in result["layers"]}
    assert set(layers) == {(weights, kind) for weights in ("fp8", "int4") for kind in KINDS}
    assert all(row["layers"] == 4 and 0 < row["median"] <= row["max"] for row in layers.values())
    # The formats' own rounding: int8 rows finer than fp8's, int4 groups coarser (about 0.006, 0.025, 0.17).
    for kind in KINDS[:-1]:
        assert layers["int4", kind]["format"] == "int8"
        assert layers["int4", kind]["max"] < layers["fp8", kind]["median"]
    assert layers["fp8", "experts"]["max"] < layers["int4", "experts"]["median"]


def test_the_wide_demo_quantizes_its_experts_in_int4_groups_of_128(tmp_path):
    path = ensure_demo_checkpoint(tmp_path / "demo-wide", WIDE)

    loaded = load_model(Settings(model=str(path), device="cpu", dtype="float32", weights="int4",
                                 cache_dir=str(tmp_path / "cache")))

    experts = loaded.model.thinker.model.language_model.layers[0].mlp.experts
    assert experts.gate_up.group == experts.down.group == 128
    assert experts.gate_up.scales.shape == (WIDE.experts, 2 * WIDE.moe_intermediate, WIDE.hidden // 128)
    assert experts.down.scales.shape == (WIDE.experts, WIDE.hidden, WIDE.moe_intermediate // 128)
