"""Quantized layers kept on disk (model/quantized/stored.py): the first start with quantized weights
writes them under <cache_dir>/quantized/<fingerprint>-<format>/, and later starts read them back
instead of quantizing again, the same tensors; the store is found by the weights' contents, and a
damaged one (its shards' digests checked at each load) or a foreign one is made again, as is none where
the disk refuses it: the model loads either way."""

import json
import shutil
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from omni_local.api import OmniLocal
from omni_local.model import load_model
from omni_local.model.quantized import QUANTIZED_LAYERS, QuantizedEmbedding, QuantizedExperts, QuantizedLinear
from omni_local.model.quantized import stored as stored_module
from omni_local.model.quantized.stored import checkpoint_fingerprint, filled_from_disk
from omni_local.model.weights import weight_files

DECODER_STACKS = ("thinker.model.language_model.layers.", "talker.model.layers.")


@pytest.fixture
def int4_settings(demo_settings, demo_checkpoint, tmp_path):
    return demo_settings.replace(weights="int4", speech=True, cache_dir=str(tmp_path / "cache"))


def quantized_tensors(settings) -> dict[str, torch.Tensor]:
    model = load_model(settings).model
    return {name: t for name, t in model.state_dict().items() if name.endswith((".values", ".scales"))}


def stores(settings) -> list[Path]:
    return [p for p in (Path(settings.cache_dir) / "quantized").iterdir() if p.is_dir()]


def refuse_quantizing(monkeypatch):
    def refused(*args, **kwargs):
        raise AssertionError("quantized again")

    monkeypatch.setattr(QuantizedLinear, "take_weight", refused)
    monkeypatch.setattr(QuantizedEmbedding, "take_weight", refused)
    monkeypatch.setattr(QuantizedExperts, "take_expert_weight", refused)


def test_a_later_start_reads_the_quantized_layers_back_and_quantizes_nothing(int4_settings, monkeypatch):
    first = load_model(int4_settings).model
    assert not filled_from_disk(first)
    [store] = stores(int4_settings)
    assert store.name.endswith("-int4") and (store / "manifest.json").is_file()
    assert stat.S_IMODE(store.parent.stat().st_mode) == 0o700

    refuse_quantizing(monkeypatch)
    second = load_model(int4_settings).model

    assert filled_from_disk(second)
    theirs = second.state_dict()
    assert all(torch.equal(tensor, theirs[name]) for name, tensor in first.state_dict().items())
    assert all(layer.prefilled for layer in second.modules() if isinstance(layer, QUANTIZED_LAYERS))


def test_the_store_is_found_by_the_weights_contents_not_their_path(int4_settings, demo_checkpoint, tmp_path):
    copy = shutil.copytree(demo_checkpoint, tmp_path / "copy")
    root = tmp_path / "fingerprints"
    root.mkdir()
    same = checkpoint_fingerprint(root, weight_files(copy))
    assert same == checkpoint_fingerprint(root, weight_files(demo_checkpoint)) and len(same) == 64

    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # the last byte of the last tensor
    weights.write_bytes(bytes(data))
    assert checkpoint_fingerprint(root, weight_files(copy)) != same


@pytest.mark.parametrize("damage", ["a truncated shard", "bytes overwritten inside a shard", "a missing tensor",
                                    "another version"])
def test_a_damaged_or_foreign_store_is_made_again_and_the_model_is_the_same(int4_settings, damage):
    expected = quantized_tensors(int4_settings)
    [store] = stores(int4_settings)
    shard = next(store.glob("*.safetensors"))
    if damage == "a truncated shard":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif damage == "bytes overwritten inside a shard":
        overwrite_inside(shard)
    elif damage == "a missing tensor":
        tensors = load_file(shard)
        tensors.pop(next(iter(tensors)))
        save_file(tensors, shard)
    else:
        manifest = json.loads((store / "manifest.json").read_text())
        (store / "manifest.json").write_text(json.dumps({**manifest, "version": manifest["version"] + 1}))

    model = load_model(int4_settings).model

    assert not filled_from_disk(model)
    assert all(torch.equal(t, model.state_dict()[name]) for name, t in expected.items())
    assert filled_from_disk(load_model(int4_settings).model), "the store was written again"


def overwrite_inside(shard: Path, count: int = 4096) -> None:
    """`count` bytes amid `shard`'s tensors made others, its size and header as they were."""
    data = bytearray(shard.read_bytes())
    header_end = 8 + int.from_bytes(data[:8], "little")
    middle = (header_end + len(data)) // 2
    assert middle - header_end > count and len(data) - middle > count
    data[middle : middle + count] = bytes(byte ^ 0xFF for byte in data[middle : middle + count])
    shard.write_bytes(bytes(data))


def test_a_store_with_bytes_overwritten_inside_a_shard_is_quantized_again_saying_so_and_replies_as_before(
    int4_settings, caplog
):
    settings = int4_settings.replace(speech=False)
    with OmniLocal(settings) as first:  # quantizes, and writes the store
        expected = first.session().send("Hello there", max_new_tokens=12).result().token_ids
    [store] = stores(settings)
    shard = store / "layers-00000.safetensors"
    size = shard.stat().st_size
    overwrite_inside(shard)
    assert shard.stat().st_size == size

    with OmniLocal(settings) as second:
        assert not filled_from_disk(second.backend.loaded.model)
        assert second.session().send("Hello there", max_new_tokens=12).result().token_ids == expected

    assert (f"the quantized layers in '{store}' cannot be read (layers-00000.safetensors is not as it was written: "
            "its BLAKE3 digest differs): quantizing the checkpoint again") in caplog.text
    assert filled_from_disk(load_model(settings).model), "the store was written again"


def test_a_store_made_before_int4_kept_the_thinkers_heads_and_encoders_in_int8_is_made_again_not_misread(
    int4_settings, caplog
):
    expected = quantized_tensors(int4_settings)
    assert any(name.startswith("thinker.model.visual.") for name in expected)
    [store] = stores(int4_settings)
    for shard in store.glob("*.safetensors"):  # as version 1 wrote it: the decoder stacks' layers alone
        kept = {name: t for name, t in load_file(shard).items() if name.startswith(DECODER_STACKS)}
        save_file(kept, shard)
    manifest = json.loads((store / "manifest.json").read_text())
    (store / "manifest.json").write_text(json.dumps({**manifest, "version": 1}))

    model = load_model(int4_settings).model

    assert not filled_from_disk(model) and "cannot be read" not in caplog.text
    assert all(torch.equal(t, model.state_dict()[name]) for name, t in expected.items())
    assert filled_from_disk(load_model(int4_settings).model), "the store was written again"


def test_where_the_disk_refuses_the_store_the_model_loads_and_no_partial_store_is_left(int4_settings, monkeypatch):
    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(stored_module, "save_file", disk_full)

    model = load_model(int4_settings).model

    assert isinstance(model.thinker.model.language_model.layers[0].mlp.experts, QuantizedExperts)
    assert stores(int4_settings) == []
