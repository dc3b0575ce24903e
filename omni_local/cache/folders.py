"""The app's folders on disk are the user's alone."""

import os
from pathlib import Path


def private_folder(path: Path) -> Path:
    """`path`, created if missing, with it and every folder created on the way at mode 0700."""
    created = [p for p in (path, *path.parents) if not p.exists()]
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    for folder in {path, *created}:
        os.chmod(folder, 0o700)  # also when it existed: umask or an older version may have opened it up
    return path
