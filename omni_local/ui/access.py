"""Who can reach the UI, and where uploads go.

By default the UI listens on 127.0.0.1 only. Serving beyond this machine is an explicit choice:
`ui_host` set to another address, and `ui_credentials_file` naming a private file (mode 0600) of
`user:password` lines, which Gradio then asks for. Uploads are kept in the app's own private
folder (`<cache_dir>/uploads`, mode 0700; with logins, a folder of each user's own in it:
ui/uploads.py), not the system's shared temporary folder; an upload the disk has no room for is
refused in words, and leaves nothing behind. Every request's Host and Origin are checked first of
all (omni_local/hosts.py).
"""

import contextlib
import errno
import logging
import os
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omni_local.access import is_loopback, read_private_text
from omni_local.errors import SettingsError
from omni_local.folders import private_folder
from omni_local.server.hosts import HostCheck, ServedNames
from omni_local.settings import Settings
from omni_local.ui.uploads import OwnUploads

log = logging.getLogger(__name__)


def keep_uploads_private(settings: Settings) -> Path:
    """Point Gradio's upload folder at the app's private one; call before Gradio is imported."""
    folder = private_folder(upload_folder(settings))
    os.environ["GRADIO_TEMP_DIR"] = str(folder)
    return folder


def upload_folder(settings: Settings) -> Path:
    return settings.cache_path / "uploads"


def launch_options(settings: Settings) -> dict[str, Any]:
    """`launch()` arguments: the address, port and upload limit, credentials when needed, the check of
    Host and Origin, and the handling of failed uploads."""
    names = ServedNames(settings.ui_host, settings.allowed_hosts)
    options: dict[str, Any] = {
        "server_name": settings.ui_host, "server_port": settings.ui_port, "max_file_size": settings.max_upload_bytes,
        "app_kwargs": {"middleware": [Middleware(UploadFaults, folder=upload_folder(settings)),
                                      Middleware(OwnUploads, folder=upload_folder(settings),
                                                 logins=bool(settings.ui_credentials_file))],
                       "lifespan": checked_first(names)},
    }
    if settings.ui_credentials_file:
        options["auth"] = read_credentials(Path(settings.ui_credentials_file).expanduser())
    elif not is_loopback(settings.ui_host):
        raise SettingsError(
            f"serving beyond this machine (ui_host = '{settings.ui_host}') needs credentials: set "
            "ui_credentials_file to a private file (chmod 600) of 'user:password' lines"
        )
    return options


def checked_first(names: ServedNames) -> Callable[[Starlette], AbstractAsyncContextManager[None]]:
    """A lifespan for Gradio's app that puts the Host and Origin check around all of it. launch() adds
    Gradio's CORS middleware outside any middleware given to it, and that one answers preflights
    itself and grants a page's origin whenever the Host is not named like localhost. uvicorn runs the
    lifespan before it serves a request, and the app has built its middleware by then."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        app.middleware_stack = HostCheck(app.middleware_stack, names)
        yield

    return lifespan


def read_credentials(path: Path) -> list[tuple[str, str]]:
    lines = read_private_text(path, "ui_credentials_file").splitlines()
    pairs = [tuple(line.split(":", 1)) for line in lines if line.strip()]
    if not pairs or any(len(pair) != 2 or not all(pair) for pair in pairs):
        raise SettingsError(f"ui_credentials_file '{path}' must hold 'user:password' lines")
    return pairs


class UploadFaults:
    """Around Gradio's upload route, which writes each file into the upload folder as `tmp...` and
    renames it into a subfolder once complete. A disk error while it writes (a full disk, above all)
    would end in a bare "Internal Server Error" and leave the partial file taking up the disk; here
    the page gets the reason in words (it shows "HTTP 507: ..."), and the partial files go."""

    def __init__(self, app: ASGIApp, folder: Path) -> None:
        self.app, self.folder = app, folder
        self._uploading = 0  # uploads being written; all of them run on the server's one event loop

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].endswith("/gradio_api/upload"):
            await self.app(scope, receive, send)
            return
        answered = False

        async def watched(message: Message) -> None:
            nonlocal answered
            answered = answered or message["type"] == "http.response.start"
            await send(message)

        self._uploading += 1
        try:
            await self.app(scope, receive, watched)
        except OSError as error:
            if answered:
                raise
            if self._uploading == 1:  # no other upload is writing one of them
                self._remove_partial_files()
            reason = error.strerror or str(error)
            log.warning("an upload failed: %s", reason)
            full = error.errno in (errno.ENOSPC, errno.EDQUOT)
            await PlainTextResponse(f"the file could not be saved: {reason}",
                                    status_code=507 if full else 500)(scope, receive, send)
        finally:
            self._uploading -= 1

    def _remove_partial_files(self) -> None:
        # tempfile's names, in the folder or a user's (ui/uploads.py); complete uploads are in subfolders
        for path in [*self.folder.glob("tmp*"), *self.folder.glob("user-*/tmp*")]:
            if path.is_file():
                path.unlink(missing_ok=True)
