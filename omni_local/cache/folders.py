"""The app's folders on disk are the user's alone."""

import os
import tempfile
from pathlib import Path


def private_folder(path: Path) -> Path:
    """`path`, created if missing, with it and every folder created on the way at mode 0700."""
    created = [p for p in (path, *path.parents) if not p.exists()]
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    for folder in {path, *created}:
        os.chmod(folder, 0o700)  # also when it existed: umask or an older version may have opened it up
    return path


def keep_compiled_code_in(folder: Path) -> None:
    """Have torch.compile keep its on-disk cache (inductor's compiled graphs, which it unpickles when
    it loads them back, and Triton's kernels) in `folder`, made private; not in the temporary folder
    torch picks by default (/tmp/torchinductor_<user>), which another user could create first and
    fill. A folder the user chose (TORCHINDUCTOR_CACHE_DIR) stays theirs."""
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen is None or _torch_default(Path(chosen)):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(private_folder(folder))  # read at each compile


def _torch_default(folder: Path) -> bool:
    """Whether `folder` is torch's default cache folder, which torch writes into the variable itself
    once it has used it: not a choice of the user's."""
    return folder.parent == Path(tempfile.gettempdir()) and folder.name.startswith("torchinductor_")
