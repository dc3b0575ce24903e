"""Encoder outputs by media digest: a memory tier, and an optional disk tier that survives restarts.

A known image or clip then skips preprocessing and its encoder, in any chat and after a restart.
The key is the medium's content digest within a namespace that covers the encoder weights, dtype
and preprocessing settings (`encoder_namespace`), so a changed model never reads stale outputs.

The disk tier is a diskcache folder that holds only bytes: each entry is a safetensors blob
(tensors, no code), and the storage class refuses any pickled value, so nothing on disk is ever
unpickled. A damaged entry is dropped and recomputed. A damaged database (found so on opening it
or on any read or write) is deleted with its entries and made again empty, saying so: left in place,
it would turn the disk tier off at every start. A disk that cannot be used otherwise (read-only,
full) turns the disk tier off with one warning, and serving goes on.
"""

import logging
import shutil
import sqlite3
from collections import OrderedDict
from pathlib import Path

import blake3
import diskcache
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from omni_local.errors import SettingsError
from omni_local.folders import private_folder

log = logging.getLogger(__name__)

EncoderOutput = dict[str, torch.Tensor]  # image: "embeds", "deepstack.0", ...; audio: "embeds"
# SQLite's (primary) result codes for a file that is damaged, or no database at all.
_DAMAGED_CODES = (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB)


class BytesOnlyDisk(diskcache.Disk):
    """diskcache storage that keeps raw bytes and never unpickles what it reads."""

    def store(self, value, read, key=diskcache.core.UNKNOWN):
        if type(value) is not bytes:
            raise TypeError("the encoder cache stores bytes only")
        return super().store(value, read, key)

    def fetch(self, mode, filename, value, read):
        if mode not in (diskcache.core.MODE_RAW, diskcache.core.MODE_BINARY):
            raise ValueError(f"refusing a disk cache value of mode {mode} (only bytes are stored)")
        return super().fetch(mode, filename, value, read)


class EncoderCache:
    def __init__(
        self, namespace: bytes, memory_bytes: int, device: torch.device, disk_dir: Path | None, disk_bytes: int
    ) -> None:
        self.namespace = namespace
        self.memory_budget = memory_bytes
        self.device = device
        self._memory: OrderedDict[bytes, EncoderOutput] = OrderedDict()
        self._memory_bytes = 0
        self.disk_bytes = disk_bytes
        self._disk_dir = disk_dir
        self._disk = _open_disk(disk_dir, disk_bytes) if disk_dir is not None else None
        self._warned_too_small = False

    @property
    def memory_bytes(self) -> int:
        return self._memory_bytes

    @property
    def disk_enabled(self) -> bool:
        return self._disk is not None

    def get(self, digest: bytes) -> EncoderOutput | None:
        key = self._key(digest)
        output = self._memory.get(key)
        if output is not None:
            self._memory.move_to_end(key)
            return output
        output = self._read_disk(key)
        if output is not None:
            self._remember(key, output)
        return output

    def put(self, digest: bytes, output: EncoderOutput) -> None:
        key = self._key(digest)
        self._remember(key, output)
        self._write_disk(key, output)

    def discard(self, digest: bytes) -> None:
        """Forget the output for `digest`, in memory and on disk."""
        key = self._key(digest)
        output = self._memory.pop(key, None)
        if output is not None:
            self._memory_bytes -= _size(output)
        if self._disk is not None:
            self._delete_on_disk(key.hex())

    def close(self) -> None:
        """Close the calling thread's connection to the disk tier (diskcache keeps one per thread)."""
        if self._disk is not None:
            self._disk.close()

    def _key(self, digest: bytes) -> bytes:
        return blake3.blake3(self.namespace + digest).digest()

    def _remember(self, key: bytes, output: EncoderOutput) -> None:
        size = _size(output)
        if size > self.memory_budget or key in self._memory:
            return
        while self._memory_bytes + size > self.memory_budget:
            _, evicted = self._memory.popitem(last=False)
            self._memory_bytes -= _size(evicted)
        self._memory[key] = output
        self._memory_bytes += size

    def _read_disk(self, key: bytes) -> EncoderOutput | None:
        if self._disk is None:
            return None
        name = key.hex()
        try:
            blob = self._disk.get(name)
        except (OSError, sqlite3.Error) as error:
            self._disk_failed("reading it", error)
            return None
        except ValueError as error:  # a value this cache never writes: treat it as damage
            return self._drop_damaged(name, error)
        if blob is None:
            return None
        try:
            tensors = load_tensors(blob)
        except Exception as error:  # noqa: BLE001 - safetensors reports damage as several error types
            return self._drop_damaged(name, error)
        return {k: v.to(self.device) for k, v in tensors.items()}

    def _write_disk(self, key: bytes, output: EncoderOutput) -> None:
        if self._disk is None:
            return
        blob = save_tensors({k: v.detach().to("cpu").contiguous() for k, v in output.items()})
        if len(blob) > self.disk_bytes:
            if not self._warned_too_small:
                log.warning(
                    "encoder disk cache: an entry of %d bytes is over disk_cache_bytes (%d); such entries are not kept",
                    len(blob), self.disk_bytes,
                )
                self._warned_too_small = True
            return
        try:
            self._disk.set(key.hex(), blob)
        except (OSError, sqlite3.Error) as error:
            self._disk_failed("writing to it", error)

    def _drop_damaged(self, name: str, error: Exception) -> None:
        log.warning("encoder disk cache: dropped a damaged entry (%s); it is computed again", error)
        self._delete_on_disk(name)
        return None

    def _delete_on_disk(self, name: str) -> None:
        try:
            self._disk.delete(name)
        except (OSError, sqlite3.Error) as error:
            self._disk_failed("removing an entry", error)

    def _disk_failed(self, doing: str, error: OSError | sqlite3.Error) -> None:
        """After an error from the disk tier: one that says its database is damaged has it made again
        empty; any other turns the tier off."""
        self._close_disk()
        if _damaged(error):
            self._disk = _open_disk(self._disk_dir, self.disk_bytes, damaged=error)
        else:
            log.warning("encoder disk cache turned off: %s failed (%s); encoder outputs are kept in memory only",
                        doing, error)

    def _close_disk(self) -> None:
        try:
            self._disk.close()
        except (OSError, sqlite3.Error):
            pass
        self._disk = None


def _size(output: EncoderOutput) -> int:
    return sum(t.numel() * t.element_size() for t in output.values())


def _open_disk(folder: Path, size_limit: int, damaged: sqlite3.Error | None = None) -> diskcache.Cache | None:
    """The disk tier in `folder`, made again empty where its database is `damaged` (the error that
    said so) or found so on opening; None, saying so, where it cannot be used."""
    try:
        if damaged is not None:
            _delete_damaged(folder, damaged)
        private_folder(folder)
        return diskcache.Cache(
            str(folder), disk=BytesOnlyDisk, size_limit=size_limit, eviction_policy="least-recently-used"
        )
    except (OSError, sqlite3.Error, SettingsError) as error:  # SettingsError: no folder, or not the user's alone
        if damaged is None and _damaged(error):
            return _open_disk(folder, size_limit, damaged=error)
        log.warning("encoder disk cache turned off: cannot open %s (%s); encoder outputs are kept in memory only",
                    folder, error)
        return None


def _delete_damaged(folder: Path, error: sqlite3.Error) -> None:
    """Delete the folder of a disk tier whose database is damaged: its entries' files are named only
    there, and every entry is an encoder output that can be computed again."""
    log.warning("encoder disk cache: the database in %s is damaged (%s): deleted it and its entries; the disk cache "
                "starts again empty", folder, error)
    shutil.rmtree(folder)


def _damaged(error: Exception) -> bool:
    return isinstance(error, sqlite3.Error) and (getattr(error, "sqlite_errorcode", 0) & 0xFF) in _DAMAGED_CODES


def encoder_namespace(thinker_model: torch.nn.Module, processor: object) -> bytes:
    """A digest of what an encoder output depends on besides the medium: the vision and audio
    encoders' weights (every parameter's bytes, not a file name), their dtype, the processor's
    preprocessing settings (images', videos' and sounds'), and the kind of device the encoders and
    the image and video preprocessing run on (a GPU's resize and kernels round otherwise than the
    CPU's, so a disk cache written by one is not read by the other)."""
    hasher = blake3.blake3(b"omni_local encoder cache v2\0", max_threads=blake3.blake3.AUTO)
    for prefix, module in (("visual", thinker_model.visual), ("audio", thinker_model.audio_tower)):
        for name, tensor in sorted(module.state_dict().items()):
            hasher.update(f"{prefix}.{name}:{tensor.dtype}:{tuple(tensor.shape)}\0".encode())
            hasher.update(tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    hasher.update(f"device:{next(thinker_model.visual.parameters()).device.type}\0".encode())
    for part in (processor.image_processor, processor.video_processor, processor.feature_extractor):
        settings = getattr(part, "to_json_string", None)  # a stand-in for a missing video processor has none
        hasher.update((settings() if settings else type(part).__name__).encode())
    return hasher.digest()
