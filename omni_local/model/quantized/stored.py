"""Quantized layers kept on disk: every start after the first reads them back instead of quantizing
the checkpoint's full-precision tensors again.

<cache_dir>/quantized/<fingerprint>-<format>/ holds the quantized layers' tensors (values and
scales, named as in the model: `thinker.model.language_model.layers.0.mlp.experts.gate_up_values`) in
safetensors shards of up to SHARD_BYTES, and `manifest.json`: what made them (our quantization's
VERSION, the model's dtype) and each shard's name and full-length BLAKE3 digest. Nothing is
unpickled. The fingerprint is a BLAKE3 hash of the contents of the checkpoint's weight files, so a
copy of the checkpoint elsewhere finds the same layers and changed weights never do; a file's hash
is remembered by its path, size and modification time (files.json), so only the first start reads
the weights twice.

A store is written into a temporary folder, its manifest last, then renamed into place whole. At
each load every shard is hashed again, on every core, and checked against its digest before a
tensor is read: bytes changed inside a shard (its size and header intact) would otherwise load as
other weights, with no error. (Hashing takes about 0.3 s per GiB on one core of a desktop CPU; the
shards are read from the page cache after.) A store that cannot be read back (a damaged shard, a
missing tensor) is deleted, saying so; one of another version is written again (those before 3
kept no digests: nothing tells whether their shards are intact). Either way the layers are
quantized from the checkpoint again and the app starts.
"""

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import blake3
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from omni_local.folders import private_folder
from omni_local.model.host_experts import placed
from omni_local.model.quantized import QUANTIZED_LAYERS

log = logging.getLogger(__name__)

# Of the formats' arithmetic and layout (formats.py) and of the layers a format quantizes: a store of
# another is made again. 2: int4 also keeps the Thinker's embeddings, lm_head and encoders in int8.
# 3: the manifest holds each shard's digest.
VERSION = 3
SHARD_BYTES = 512 << 20  # at most this much host memory holds a shard's tensors while it is written
_MANIFEST = "manifest.json"


@dataclass(frozen=True)
class StoredLayers:
    folder: Path
    dtype: torch.dtype

    @classmethod
    def at(cls, cache_dir: Path, weight_files: list[Path], format: str, dtype: torch.dtype) -> "StoredLayers":
        root = private_folder(cache_dir / "quantized")
        return cls(root / f"{checkpoint_fingerprint(root, weight_files)}-{format}", dtype)

    def fill(self, model: torch.nn.Module, device: torch.device) -> bool:
        """Read the stored tensors into `model`'s quantized layers (swapped in, still empty) and mark
        them `prefilled`; False, with the layers left empty, if there is no usable store here."""
        shards = self._shards()
        if shards is None:
            if (self.folder / _MANIFEST).exists():
                log.info("the quantized layers in '%s' were kept by another version of omni_local, or for another "
                         "dtype: quantizing the checkpoint again", self.folder)
            return False
        layers = _quantized_layers(model)
        try:
            # The names first (the shards' headers alone): a store of other layers is never read whole.
            stored = {name: set(parts) for name, parts in _by_layer(_keys(self.folder, shards)).items()}
            if stored != {name: _tensor_names(layer) for name, layer in layers.items()}:
                raise ValueError("its tensors are not this model's quantized layers'")
            _check_digests(self.folder, shards)
            held = _by_layer(_read(self.folder, shards, layers, device))
        except (OSError, SafetensorError, ValueError) as error:
            log.warning("the quantized layers in '%s' cannot be read (%s): quantizing the checkpoint again",
                        self.folder, error)
            shutil.rmtree(self.folder, ignore_errors=True)
            return False
        for name, layer in layers.items():
            _hold(layer, held[name], self.dtype)
        return True

    def save(self, model: torch.nn.Module) -> None:
        """Write `model`'s quantized layers here, a shard at a time through host memory. A store
        that cannot be written (a full disk) is left out, saying so: the next start quantizes again."""
        if self._shards() is not None:
            return  # written meanwhile by another start
        tensors = {f"{name}.{part}": tensor for name, layer in _quantized_layers(model).items()
                   for part, tensor in (*layer.named_buffers(recurse=False), *layer.named_parameters(recurse=False))}
        partial = self.folder.with_name(f"{self.folder.name}.partial-{os.getpid()}")
        try:
            partial.mkdir(mode=0o700)
            shards = dict(_write_shard(partial, i, group) for i, group in enumerate(_groups(tensors)))
            manifest = {"version": VERSION, "dtype": str(self.dtype), "shards": shards}
            (partial / _MANIFEST).write_text(json.dumps(manifest), encoding="utf-8")
            shutil.rmtree(self.folder, ignore_errors=True)  # another version's, or an interrupted write's
            os.replace(partial, self.folder)
        except OSError as error:
            log.warning("could not keep the quantized layers in '%s' (%s): the next start quantizes again",
                        self.folder, error)
        finally:
            shutil.rmtree(partial, ignore_errors=True)

    def _shards(self) -> dict[str, str] | None:
        """The shards' names and digests, if a complete store of this version and dtype is here."""
        try:
            manifest = json.loads((self.folder / _MANIFEST).read_text(encoding="utf-8"))
            if manifest["version"] == VERSION and manifest["dtype"] == str(self.dtype):
                return {str(shard): str(digest) for shard, digest in manifest["shards"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
        return None


def checkpoint_fingerprint(root: Path, weight_files: list[Path]) -> str:
    """A full-length BLAKE3 hex digest of the weight files' contents, in their order."""
    memo_file = root / "files.json"
    try:
        memo = json.loads(memo_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        memo = {}
    combined = blake3.blake3(b"omni_local checkpoint weights\0")
    for file in weight_files:
        info, key = file.stat(), str(file.resolve())
        seen = memo.get(key)
        if not (isinstance(seen, list) and seen[:2] == [info.st_size, info.st_mtime_ns]):
            memo[key] = seen = [info.st_size, info.st_mtime_ns, _digest(file)]
        combined.update(bytes.fromhex(seen[2]))
    written = memo_file.with_name(f"files.json.{os.getpid()}")
    try:
        written.write_text(json.dumps(memo), encoding="utf-8")
        os.replace(written, memo_file)
    except OSError as error:  # a full disk: the next start hashes the files again
        written.unlink(missing_ok=True)
        log.warning("could not keep the weight files' hashes in '%s': %s", memo_file, error)
    return combined.hexdigest()


def filled_from_disk(model: torch.nn.Module) -> bool:
    """Whether `model`'s quantized layers were read back from a store (`fill`)."""
    return any(layer.prefilled for layer in _quantized_layers(model).values())


def _quantized_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {name: module for name, module in model.named_modules() if isinstance(module, QUANTIZED_LAYERS)}


def _tensor_names(layer: torch.nn.Module) -> set[str]:
    """A quantized layer's tensors once loaded: its buffers (registered empty, as None) and parameters."""
    return set(layer._buffers) | {name for name, parameter in layer._parameters.items() if parameter is not None}


def _check_digests(folder: Path, shards: dict[str, str]) -> None:
    """Raise ValueError naming the first shard whose contents are not those written."""
    for shard, digest in shards.items():
        if _digest(folder / shard) != digest:
            raise ValueError(f"{shard} is not as it was written: its BLAKE3 digest differs")


def _digest(file: Path) -> str:
    return blake3.blake3(max_threads=blake3.blake3.AUTO).update_mmap(file).hexdigest()


def _keys(folder: Path, shards: dict[str, str]) -> dict[str, None]:
    keys = {}
    for shard in shards:
        with safe_open(folder / shard, framework="pt", device="cpu") as opened:
            keys.update(dict.fromkeys(opened.keys()))
    return keys


def _read(folder: Path, shards: dict[str, str], layers: dict[str, torch.nn.Module], device: torch.device
          ) -> dict[str, torch.Tensor]:
    """Each stored tensor, where its layer holds it: on `device`, or experts marked for host memory
    there (model/host_experts.py), never on the GPU first."""
    read = {}
    for shard in shards:
        with safe_open(folder / shard, framework="pt", device="cpu") as opened:
            for key in opened.keys():
                read[key] = placed(layers[key.rpartition(".")[0]], opened.get_tensor(key), device)
    return read


def _by_layer(tensors: dict[str, object]) -> dict[str, dict[str, object]]:
    """`tensors` by name (`<layer>.<part>`) as {layer: {part: tensor}}."""
    layers: dict[str, dict[str, object]] = {}
    for key, tensor in tensors.items():
        layer, _, part = key.rpartition(".")
        layers.setdefault(layer, {})[part] = tensor
    return layers


def _hold(layer: torch.nn.Module, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    for name, tensor in tensors.items():
        setattr(layer, name, torch.nn.Parameter(tensor, requires_grad=False) if name in layer._parameters else tensor)
    if hasattr(layer, "hold"):  # a quantized Linear decides how it multiplies, a table its rows' dtype
        layer.hold(layer.values, layer.scales, dtype)
    layer.prefilled = True


def _groups(tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """The tensors in order, cut into groups of at most SHARD_BYTES (a larger tensor alone)."""
    groups, size = [{}], 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > SHARD_BYTES:
            groups.append({})
            size = 0
        groups[-1][name] = tensor
        size += nbytes
    return groups


def _write_shard(folder: Path, index: int, group: dict[str, torch.Tensor]) -> tuple[str, str]:
    """The shard's name and the digest of its file as written."""
    name = f"layers-{index:05d}.safetensors"
    save_file({key: t.detach().to("cpu").contiguous() for key, t in group.items()}, folder / name)
    return name, _digest(folder / name)
