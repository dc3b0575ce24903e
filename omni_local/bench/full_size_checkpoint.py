"""A checkpoint at a config's full size, on disk, for timing start-ups from disk (bench/start_up.py):
no real checkpoint can be downloaded on our machines, and the bf16 one (65.7 GiB) would not fit
beside its quantized store on a 64 GB disk.

    python -m omni_local.bench.full_size_checkpoint CONFIG.json FOLDER --weights int4

The files hold the real checkpoint's tensors (named as transformers' model names them, which the
loader reads as it reads the original names), shapes and sizes in bfloat16, beside the demo's tokenizer
and processor files (the config's token ids remapped onto them, as bench/random_weights.py does).
The tensors the `weights` format quantizes are holes of their files: zeros that take no disk and are
read without a disk read; only the first start reads them, quantizing each as a real one. Every other
tensor is written, random (a start after the first reads these from the files, and the quantized
layers from their store): a checkpoint for timing, whose answers are noise. A bf16 `weights` writes
every tensor (as much disk as the real checkpoint).
"""

import argparse
import json
import math
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import Qwen3OmniMoeForConditionalGeneration

from omni_local.bench.random_weights import full_size_config
from omni_local.model.demo import MARKER_FILE, ensure_demo_checkpoint
from omni_local.model.quantized import quantized_places
from omni_local.model.weights import checkpoint_shapes
from omni_local.model.workarounds import load_processor
from omni_local.settings import Settings

SHARD_BYTES = 5 << 30  # as Qwen's own checkpoints are sharded: about 5 GB a file
_STD = 0.02  # the written tensors' spread, as the config's initializer_range


def write_full_size_checkpoint(config_path: Path, folder: Path, weights: str, demo: Path | None = None
                               ) -> dict[str, int]:
    """Writes the checkpoint, with its Talker and Code2Wav, into `folder` (new or empty); returns its
    bytes: "files" (their sizes) and "written" (the tensors not left as holes)."""
    demo = ensure_demo_checkpoint(demo or Settings().demo_path)
    processor = load_processor(demo)
    config = full_size_config(config_path, processor.tokenizer, speech=True)
    with torch.device("meta"):
        model = Qwen3OmniMoeForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
    shapes = checkpoint_shapes(model)
    holes = _quantized_prefixes(model, weights)
    folder.mkdir(parents=True, exist_ok=True)
    if any(folder.iterdir()):
        raise FileExistsError(f"'{folder}' is not empty")
    generator = torch.Generator().manual_seed(0)
    weight_map, written = {}, 0
    for index, shard in enumerate(_shards(shapes), start=1):
        name = f"model-{index:05d}.safetensors"
        written += _write_shard(folder / name, shard, holes, generator)
        weight_map |= dict.fromkeys(shard, name)
    total = sum(math.prod(shape) * 2 for shape in shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2), encoding="utf-8")
    config.save_pretrained(folder)
    for file in demo.iterdir():  # the tokenizer, processor, chat template and generation config
        if file.is_file() and not file.name.startswith(("model.safetensors", "config.json", MARKER_FILE)):
            shutil.copy(file, folder / file.name)
    return {"files": total, "written": written}


def _quantized_prefixes(model: torch.nn.Module, weights: str) -> tuple[str, ...]:
    """The name prefixes of the checkpoint's tensors that `weights` quantizes."""
    names = {id(module): name for name, module in model.named_modules()}
    return tuple(f"{names[id(parent)]}.{attribute}." for parent, attribute, _ in quantized_places(model, weights))


def _shards(shapes: dict[str, torch.Size]) -> Iterator[dict[str, torch.Size]]:
    """The tensors in name order, cut into shards of up to SHARD_BYTES."""
    shard, size = {}, 0
    for name in sorted(shapes):
        nbytes = math.prod(shapes[name]) * 2
        if shard and size + nbytes > SHARD_BYTES:
            yield shard
            shard, size = {}, 0
        shard[name] = shapes[name]
        size += nbytes
    if shard:
        yield shard


def _write_shard(path: Path, shard: dict[str, torch.Size], holes: tuple[str, ...], generator: torch.Generator
                 ) -> int:
    """A safetensors file of `shard`'s bfloat16 tensors, those under `holes` left unwritten (the file is
    sized to hold them: they read as zeros). Returns the bytes written."""
    header, offset = {}, 0
    for name, shape in shard.items():
        nbytes = math.prod(shape) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    written = 0
    with path.open("wb") as file:
        file.write(struct.pack("<Q", len(text)) + text)
        start = file.tell()
        for name, entry in header.items():
            if name.startswith(holes):
                continue
            tensor = torch.randn(math.prod(shard[name]), generator=generator).mul_(_STD).to(torch.bfloat16)
            file.seek(start + entry["data_offsets"][0])
            file.write(tensor.view(torch.uint8).numpy().tobytes())
            written += tensor.numel() * 2
        file.truncate(start + offset)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m omni_local.bench.full_size_checkpoint")
    parser.add_argument("config", type=Path, help="a full-size config.json")
    parser.add_argument("folder", type=Path, help="where the checkpoint is written (new or empty)")
    parser.add_argument("--weights", choices=["bf16", "fp8", "int4"], required=True,
                        help="the format whose quantized tensors are left as holes")
    args = parser.parse_args()
    sizes = write_full_size_checkpoint(args.config, args.folder, args.weights)
    print(f"wrote '{args.folder}': files {sizes['files'] / 2**30:.2f} GiB, of which written "
          f"{sizes['written'] / 2**30:.2f} GiB (the rest are holes)")


if __name__ == "__main__":
    main()
