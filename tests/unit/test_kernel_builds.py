"""Every Triton kernel the engine launches builds for Ampere (sm_80, sm_86), Ada (sm_89), Hopper
(sm_90) and Blackwell (sm_100, sm_120), at the real model's shapes and with the tiles the engine's
tables choose on each (omni_local/engine/kernel_builds.py), inside the architecture's shared memory;
fp8 weights and the Thinker's attention over fp8 KV on the architectures with FP8.

The builds run once a session, in a child process (this one's Triton was imported to interpret),
one worker a CPU core: about 3 minutes of 2 cores from a cold Triton cache."""

import json
import os
import re
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

import pytest

from omni_local.kernels.gemv_tiles import TUNED
from omni_local.engine.kernel_builds import ARCHITECTURES, SHARED_MEMORY_PER_BLOCK, TUNED_GPUS
from omni_local.kernels.moe.tile_configs import TILE_CONFIG_DIR, config_file_name

ROOT = Path(__file__).resolve().parents[2]
# Every kernel the package launches (`name[grid](...)`), read from its source.
LAUNCHED = sorted({name for path in (ROOT / "omni_local").rglob("*.py")
                   for name in re.findall(r"(\w+_kernel)\[", path.read_text())})
WITH_FP8 = (89, 90, 100, 120)  # Ada, Hopper, Blackwell: float8 in Triton, FP8 matrix units


@cache
def builds() -> dict[int, list[dict]]:
    """Each architecture's builds (kernel_builds.Compiled's fields), compiled at the first call."""
    compiler = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "builds.json"
        done = subprocess.run([sys.executable, "-m", "omni_local.engine.kernel_builds", "--json", str(out)],
                              cwd=ROOT, env=compiler, capture_output=True, text=True, timeout=1200)
        assert done.returncode == 0, done.stderr[-4000:]
        return {int(arch): compiled for arch, compiled in json.loads(out.read_text()).items()}


@pytest.mark.parametrize("kernel", LAUNCHED)
@pytest.mark.parametrize("arch", ARCHITECTURES, ids=lambda arch: f"sm_{arch}")
def test_each_kernel_builds_for_each_architecture_inside_its_shared_memory(arch, kernel):
    mine = [build for build in builds()[arch] if build["kernel"] == kernel]

    assert mine, f"no launch of {kernel} was built for sm_{arch}"
    assert [(b["what"], b["constants"], b["error"]) for b in mine if b["error"]] == []
    assert [(b["what"], b["constants"], b["shared"]) for b in mine
            if b["shared"] > SHARED_MEMORY_PER_BLOCK[arch]] == []


@pytest.mark.parametrize("what", ["fp8 weights", "fp8 KV"])
def test_fp8_weights_and_fp8_kv_are_built_on_the_architectures_with_fp8_units_only(what):
    with_fp8 = {arch for arch, compiled in builds().items() if any(what in b["what"] for b in compiled)}

    assert with_fp8 == set(WITH_FP8)


@pytest.mark.parametrize("arch", WITH_FP8, ids=lambda arch: f"sm_{arch}")
def test_each_attention_build_of_the_thinkers_kv_has_its_twin_over_fp8_kv(arch):
    def attention(what: str) -> list[str]:
        return sorted(b["constants"] for b in builds()[arch]
                      if b["kernel"] == "_attention_kernel" and b["what"] == f"thinker bfloat16, {what}")

    twins = sorted(constants.replace("FP8_KV=False", "FP8_KV=True") for constants in attention("bf16 weights"))
    assert twins and attention("fp8 KV") == twins


def test_every_gpu_with_tuned_tiles_is_one_whose_tiles_are_built():
    names = {gpu.name for gpu in TUNED_GPUS}

    assert {name for name, _, _ in TUNED} <= names
    for path in TILE_CONFIG_DIR.glob("*.json"):
        shape = map(int, re.match(r"experts(\d+)_hidden(\d+)_intermediate(\d+)_", path.name).groups())
        experts, hidden, intermediate = shape
        assert path.name in {config_file_name(experts, hidden, intermediate, name, quantized)
                             for name in names for quantized in (None, "fp8", "int4")}
