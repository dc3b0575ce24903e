"""Loading streams a sharded checkpoint: beyond the model itself, the host holds about one tensor at
a time, where `from_pretrained` holds a good part of the checkpoint again.

Measured by bench/load_memory.py in a fresh process: the growth of anonymous memory (the
memory-mapped shards' pages are file cache, not counted) at its peak. The test machines have no
GPU, so the model lands in host memory too; it is loaded in float32 from bfloat16 files, so every
tensor is converted and the model's own storage is all anonymous memory, subtracted exactly. On a
GPU there is nothing to subtract.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

REPO = Path(__file__).resolve().parents[2]
_PROCESSOR_FILES = ("tokenizer.json", "tokenizer_config.json", "processor_config.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def large_checkpoint(demo_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's Thinker with a 131,072-token vocabulary and 64 experts of 2,048 per layer: 225 MB
    of bfloat16 in 14 shards, its largest tensors (embeddings, output) 16 MB, an expert's 256 KiB."""
    config = Qwen3OmniMoeConfig.from_pretrained(demo_checkpoint)
    text = config.thinker_config.text_config
    text.vocab_size, text.num_experts, text.moe_intermediate_size = 131072, 64, 2048
    config.enable_audio_output = False
    path = tmp_path_factory.mktemp("large") / "checkpoint"
    Qwen3OmniMoeForConditionalGeneration._from_config(config, dtype=torch.bfloat16).save_pretrained(
        path, max_shard_size="32MB"
    )
    for name in _PROCESSOR_FILES:
        shutil.copy(demo_checkpoint / name, path / name)
    return path


def _measured(checkpoint: Path, loader: str) -> dict:
    command = [sys.executable, "-m", "omni_local.bench.load_memory", str(checkpoint), "--loader", loader,
               "--device", "cpu", "--dtype", "float32", "--json"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_loading_holds_about_one_tensor_beyond_the_model_where_from_pretrained_holds_far_more(large_checkpoint):
    streamed, whole = _measured(large_checkpoint, "omni_local"), _measured(large_checkpoint, "transformers")
    assert len(list(large_checkpoint.glob("model-*.safetensors"))) > 1
    assert streamed["checkpoint_bytes"] > 200 << 20
    largest_in_float32 = 2 * streamed["largest_tensor_bytes"]
    limit = 2 * largest_in_float32
    held = {result["loader"]: result["anon_peak_bytes"] - result["model_host_bytes"] for result in (streamed, whole)}
    assert held["omni_local"] < limit, held
    # The same measure fails the loader this one replaced: it holds merged copies of the experts.
    assert held["transformers"] > 2 * limit, held
