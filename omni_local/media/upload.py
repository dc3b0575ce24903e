"""Reading an uploaded file into memory: found, not empty, within the upload size limit."""

from dataclasses import dataclass
from pathlib import Path

from omni_local.errors import MediaError, UploadTooLarge
from omni_local.media.limits import MediaLimits, tenths

_UNITS = (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10), ("bytes", 1))


@dataclass(frozen=True)
class Upload:
    name: str  # what error messages call the file
    data: bytes


def read_upload(source: str | Path | bytes, limits: MediaLimits, name: str | None = None) -> Upload:
    """The file's bytes; `name` (else the path's file name, else "upload") names it in errors."""
    if isinstance(source, bytes):
        upload = Upload(name or "upload", source)
        _check_size(upload.name, len(source), limits)
        return upload
    path = Path(source)
    shown = name or path.name or str(path)
    try:
        if path.is_dir():
            raise MediaError(f"{shown}: is a folder, not a file")
        # The size is checked before reading, so an oversized file is never loaded into memory.
        _check_size(shown, path.stat().st_size, limits)
        data = path.read_bytes()
    except FileNotFoundError:
        raise MediaError(f"{shown}: file not found") from None
    except PermissionError:
        raise MediaError(f"{shown}: the file cannot be read (permission denied)") from None
    except OSError as error:
        raise MediaError(f"{shown}: the file cannot be read ({error.strerror or 'input/output error'})") from None
    # Checked again: the file may have changed between stat() and the read.
    _check_size(shown, len(data), limits)
    return Upload(shown, data)


def _check_size(name: str, size: int, limits: MediaLimits) -> None:
    if size == 0:
        raise MediaError(f"{name}: the file is empty")
    limit = limits.max_upload_bytes
    if size > limit:
        raise UploadTooLarge(
            f"{name}: {_amount(size, limit, up=True)} is over the upload limit of "
            f"{_amount(limit, limit, up=False)} (max_upload_bytes)"
        )


def _amount(size: int, limit: int, *, up: bool) -> str:
    """`size` in the unit that suits `limit`: "60.2 MB" against 50 MB, "5,120 bytes" against 1,000."""
    unit, scale = next((unit, scale) for unit, scale in _UNITS if limit >= scale)
    return f"{size:,} bytes" if scale == 1 else f"{tenths(size / scale, up=up)} {unit}"
