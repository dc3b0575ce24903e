"""The app's folders on disk are the user's alone.

Only a folder the app creates gets its mode from the app (0700). One that was there already keeps
its mode: it may be shared on purpose (a project folder, or the system's temporary folder, whose
sticky bit is what keeps users from deleting each other's files), so the app never changes it; a
folder it would keep data in must already be the user's alone, or is refused.
"""

import os
import stat
import tempfile
from pathlib import Path

from omni_local.errors import SettingsError

# What an entry point sets once: every file and folder the process creates from then on is closed to
# others (0600 and 0700 where 0644 and 0755 would be), also those that libraries create with default
# modes (Gradio's upload folders, diskcache's files and folders, the demo model's files, torch's).
PRIVATE_UMASK = 0o077


def keep_new_files_private() -> None:
    """For a program's entry point (app.py, `python -m omni_local`), not for the library: the umask
    belongs to the whole process, and a library that changed it would surprise the program using it."""
    os.umask(PRIVATE_UMASK)


def make_folders(path: Path) -> None:
    """`path` and the folders on the way to it, each one it creates at mode 0700 (never wider: the
    umask can only narrow it); those that were there are left as they are."""
    try:
        for folder in reversed([p for p in (path, *path.parents) if not p.exists()]):
            try:
                folder.mkdir(mode=0o700)
            except FileExistsError:
                pass  # created meanwhile by someone else: not ours to change
    except NotADirectoryError:
        file = _nearest_existing(path)
        raise SettingsError(f"cannot create folder '{path}': '{file}' is a file, not a folder") from None
    except OSError as error:
        raise SettingsError(f"cannot create folder '{path}': {error.strerror}") from None
    if not path.is_dir():
        raise SettingsError(f"'{path}' is a file, not a folder")


def private_folder(path: Path) -> Path:
    """`path`, made by `make_folders` if missing; an existing one is used only if it is the user's
    own, writable, and closed to others (the app would keep private data in it)."""
    make_folders(path)
    info = path.stat()
    if info.st_uid != os.geteuid():
        raise SettingsError(f"folder '{path}' belongs to another user: use a folder of your own")
    if info.st_mode & 0o077:
        raise SettingsError(f"folder '{path}' is open to other users (mode {stat.S_IMODE(info.st_mode):04o}): "
                            "make it private (chmod 700)")
    if not os.access(path, os.W_OK | os.X_OK):
        raise SettingsError(f"folder '{path}' is not writable")
    return path


def _nearest_existing(path: Path) -> Path:
    """The nearest of `path`'s parents that exists (where a folder could not be made: a file)."""
    return next(parent for parent in path.parents if parent.exists())


def keep_compiled_code_in(folder: Path) -> None:
    """Have torch.compile and Triton keep their on-disk caches in `folder`, made private: inductor's
    compiled graphs (which it unpickles when it loads them back), not in the temporary folder torch
    picks by default (/tmp/torchinductor_<user>), which another user could create first and fill; and
    Triton's kernels, ours and inductor's, in its `triton` folder from the first. (Inductor points
    Triton at a folder of its own only once it first builds a kernel, which a start whose graphs are
    cached does later than one that compiles them: our kernels compiled in between went to
    ~/.triton on one start and were looked for in inductor's folder on the next, and all compiled
    again, 40 s of a start of the full model.) A folder the user chose (TORCHINDUCTOR_CACHE_DIR, or
    TRITON_CACHE_DIR) stays theirs, and so do Triton's kernels with it."""
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen is None or _torch_default(Path(chosen)):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(private_folder(folder))  # read at each compile
        if "TRITON_CACHE_DIR" not in os.environ:  # read at each compile
            make_folders(folder / "triton")  # inside the private folder
            os.environ["TRITON_CACHE_DIR"] = str(folder / "triton")


def _torch_default(folder: Path) -> bool:
    """Whether `folder` is torch's default cache folder, which torch writes into the variable itself
    once it has used it: not a choice of the user's."""
    return folder.parent == Path(tempfile.gettempdir()) and folder.name.startswith("torchinductor_")
