"""The expert GEMMs' tile configs: a tuned file's config for the nearest token count at or above a
call's, the safe default for any shape or GPU without one (a forced architecture's too), and
committed files that parse."""

import json

import pytest
import torch

from omni_local.kernels.moe import tile_configs
from omni_local.kernels.triton_support import KernelGpu, building_for
from omni_local.kernels.moe.tile_configs import (
    PREFILL_DEFAULT,
    SMALL_BATCH_DEFAULT,
    TILE_CONFIG_DIR,
    GemmTile,
    TileConfig,
    config_file_name,
    tile_config,
)

CPU = torch.device("cpu")
# A GPU of the name the files below are written for, as the tables see it on the meta device.
GPU = torch.device("meta")


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(tile_configs, "TILE_CONFIG_DIR", tmp_path)
    tile_configs._tuned_configs.cache_clear()
    token = building_for.set(KernelGpu("Test GPU", (8, 6)))
    yield tmp_path
    building_for.reset(token)
    tile_configs._tuned_configs.cache_clear()


def test_a_call_takes_the_tuned_config_of_the_smallest_count_at_or_above_its_own(config_dir):
    small, large = TileConfig(16, GemmTile(32, 128, 4, 5), GemmTile(64, 64, 4, 4)), TileConfig(64, GemmTile(), GemmTile())
    (config_dir / config_file_name(8, 64, 32, "Test GPU")).write_text(json.dumps({"4": small.to_json(),
                                                                                  "64": large.to_json()}))

    assert [tile_config(8, 64, 32, tokens, GPU) for tokens in (1, 4, 5, 64, 512)] == [small, small, large, large, large]
    assert tile_config(8, 64, 32, 1, CPU) == SMALL_BATCH_DEFAULT  # Triton's interpreter: no GPU's tables


def test_a_shape_or_gpu_without_a_tuned_file_takes_the_default_for_its_path(config_dir):
    assert tile_config(128, 2048, 768, 16, GPU) == SMALL_BATCH_DEFAULT
    assert tile_config(128, 2048, 768, 17, GPU) == PREFILL_DEFAULT


def test_file_names_hold_the_shape_and_the_gpu_in_letters_digits_and_underscores_only():
    assert config_file_name(128, 2048, 768, "NVIDIA H200") == "experts128_hidden2048_intermediate768_NVIDIA_H200.json"
    assert config_file_name(128, 2048, 768, "NVIDIA H200", "int4") == (
        "experts128_hidden2048_intermediate768_NVIDIA_H200_int4.json")


def test_quantized_experts_take_their_formats_file_and_else_the_unquantized_one(config_dir):
    plain, int4 = TileConfig(16, GemmTile(32, 256, 4, 3), GemmTile()), TileConfig(16, GemmTile(64, 128, 4, 3), GemmTile())
    (config_dir / config_file_name(8, 64, 32, "Test GPU")).write_text(json.dumps({"16": plain.to_json()}))
    (config_dir / config_file_name(8, 64, 32, "Test GPU", "int4")).write_text(json.dumps({"16": int4.to_json()}))

    assert tile_config(8, 64, 32, 1, GPU, "int4") == int4
    assert tile_config(8, 64, 32, 1, GPU, "fp8") == plain
    assert tile_config(8, 64, 32, 1, GPU) == plain


@pytest.mark.parametrize("path", sorted(TILE_CONFIG_DIR.glob("*.json")), ids=lambda p: p.name)
def test_every_committed_tile_config_parses_into_tiles_tl_dot_takes(path):
    for tokens, data in json.loads(path.read_text()).items():
        config = TileConfig.from_json(data)
        assert int(tokens) > 0
        for size in (config.block_m, config.gate_up.block_n, config.gate_up.block_k, config.down.block_n,
                     config.down.block_k):
            assert size >= 16 and size & (size - 1) == 0, (path.name, tokens, config)
