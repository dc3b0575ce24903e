"""Each user's uploads their own. With logins (`ui_credentials_file`), every user is a principal
(access.py): their uploads go to a folder of their own under the uploads folder, named by a digest
of the name (any name, no path in it), and nobody else can fetch them by URL or name them in a chat.
Without logins there is one user, whose uploads are the uploads folder itself.

Gradio keeps every upload in one folder, by content (`<folder>/<sha>/<name>`), and serves any file
there to anyone logged in: a user could fetch another's image by its URL, and one user's upload of
a file landed in the folder of the first who sent it. So, around Gradio's routes, for a user who is
logged in:
- `POST .../gradio_api/upload` is written by Gradio's own upload code into the user's folder;
- `GET .../gradio_api/file=PATH` (or `file/PATH`) of a file in another user's folder is 404, as a
  file that is not there would be.
The page's handlers check each file a message names the same way (`check_own`): a request can name
any path the page's server holds.
"""

import hashlib
import math
import os
from pathlib import Path

from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from omni_local.errors import RequestError

_FILE_ROUTES = ("/gradio_api/file=", "/gradio_api/file/")
_USER_PREFIX = "user-"


def user_folder(uploads: Path, user: str | None) -> Path:
    """Where `user`'s uploads go: the uploads folder itself without logins."""
    if user is None:
        return uploads
    return uploads / f"{_USER_PREFIX}{hashlib.sha256(user.encode('utf-8', 'surrogatepass')).hexdigest()}"


def is_anothers(path: str | Path, uploads: Path, user: str | None) -> bool:
    """Whether `path` lies in the uploads folder of a user other than `user`."""
    try:
        inside = Path(os.path.abspath(path)).resolve().relative_to(uploads.resolve())
    except ValueError:
        return False  # not an upload at all
    owner = inside.parts[0] if len(inside.parts) > 1 else ""
    return owner.startswith(_USER_PREFIX) and uploads / owner != user_folder(uploads, user)


def check_own(path: str, uploads: Path, user: str | None) -> None:
    """Refuse a file of another user's that a message names (the same words as a missing file: its
    existence is not told)."""
    if is_anothers(path, uploads, user):
        raise RequestError(f"{Path(path).name}: file not found")


class OwnUploads:
    """The page's upload and file routes, each user's to their own folder (the module's docstring)."""

    def __init__(self, app: ASGIApp, folder: Path, logins: bool) -> None:
        self.app, self.folder, self.logins = app, folder, logins

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        user = _user(scope) if self.logins and scope["type"] == "http" else None
        if user is None:  # no logins, or nobody logged in: Gradio's routes as they are (they refuse the latter)
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if path.endswith("/gradio_api/upload") and scope["method"] == "POST":
            response = await _upload(Request(scope, receive), user_folder(self.folder, user))
        elif (fetched := _fetched_path(path)) is not None and is_anothers(fetched, self.folder, user):
            response = PlainTextResponse("File not found", status_code=404)
        else:
            await self.app(scope, receive, send)
            return
        await response(scope, receive, send)


def _user(scope: Scope) -> str | None:
    """Who is logged in, as Gradio's own routes tell (its login cookie, in `scope["app"]`, Gradio's
    app: Starlette sets it before any middleware runs)."""
    app, cookies = scope["app"], Request(scope).cookies
    token = cookies.get(f"access-token-{app.cookie_id}") or cookies.get(f"access-token-unsecure-{app.cookie_id}")
    return app.tokens.get(token)


def _fetched_path(route: str) -> str | None:
    for prefix in _FILE_ROUTES:
        at = route.find(prefix)
        if at >= 0:
            return route[at + len(prefix):]
    return None


async def _upload(request: Request, folder: Path) -> Response:
    """Gradio's upload route (its limit, its errors, its answer: the files' paths), into `folder`."""
    from gradio.route_utils import upload_fn  # here: Gradio is imported once its upload folder is set (access.py)

    blocks = request.app.get_blocks()
    limit = blocks.max_file_size if blocks.max_file_size is not None else math.inf
    try:
        paths, _, _ = await upload_fn(request, str(folder), limit, None, force_move=True)
    except MultiPartException as error:
        return PlainTextResponse(error.message, status_code=413 if "maximum allowed size" in error.message else 400)
    except HTTPException as error:
        return PlainTextResponse(str(error.detail), status_code=error.status_code)
    blocks.upload_file_set.update(paths)
    return JSONResponse([str(path) for path in paths])
