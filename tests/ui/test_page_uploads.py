"""The page's uploads with logins: each user's in a folder of their own, which nobody else can fetch
by URL or name in a chat. `python app.py` in a subprocess with two users, met over HTTP as the
page's own script meets it (log in, upload, fetch the file's URL)."""

import hashlib

import httpx
import pytest
from gradio_client import Client, handle_file
from gradio_client.client import Endpoint

from api_requests import png, private_file
from omni_local.errors import RequestError
from omni_local.ui.history import ERROR_TITLE
from omni_local.ui.uploads import check_own
from served_app import served_app

USERS = {"ada": "lovelace-5c1e", "bob": "babbage-90d2"}


@pytest.fixture(scope="module")
def page(demo_settings, demo_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("page_uploads")
    credentials = private_file(root / "users", "".join(f"{user}:{password}\n" for user, password in USERS.items()))
    with served_app(demo_settings, root, "--ui-credentials-file", str(credentials)) as served:
        yield served


def logged_in(page, user: str) -> httpx.Client:
    client = httpx.Client(base_url=page.url, timeout=30)
    assert client.post("login", data={"username": user, "password": USERS[user]}).status_code == 200
    return client


def upload(client: httpx.Client, name: str, data: bytes) -> str:
    answer = client.post("gradio_api/upload", files={"files": (name, data, "image/png")})
    assert answer.status_code == 200, answer.text
    [path] = answer.json()
    return path


def folder_of(page, user: str) -> str:
    return str(page.cache_dir / "uploads" / f"user-{hashlib.sha256(user.encode()).hexdigest()}")


def test_a_users_upload_is_kept_in_their_folder_and_another_users_of_the_same_file_in_theirs(page):
    image = png(4301)
    ada, bob = logged_in(page, "ada"), logged_in(page, "bob")
    adas, bobs = upload(ada, "ok.png", image), upload(bob, "ok.png", image)
    assert adas.startswith(folder_of(page, "ada") + "/") and adas.endswith("/ok.png")
    assert bobs.startswith(folder_of(page, "bob") + "/") and bobs.endswith("/ok.png")
    assert open(adas, "rb").read() == open(bobs, "rb").read() == image


def test_a_user_cannot_fetch_another_users_upload_by_its_url_but_their_own(page):
    image = png(4302)
    ada, bob = logged_in(page, "ada"), logged_in(page, "bob")
    adas = upload(ada, "private.png", image)
    mine = ada.get(f"gradio_api/file={adas}")
    assert mine.status_code == 200 and mine.content == image
    assert bob.get(f"gradio_api/file={adas}").status_code == 404
    assert bob.get(f"gradio_api/file/{adas}").status_code == 404
    assert httpx.get(f"{page.url}gradio_api/file={adas}").status_code == 401  # nobody logged in


def test_a_chat_message_that_names_another_users_upload_is_answered_as_naming_a_missing_file(page, monkeypatch):
    adas = upload(logged_in(page, "ada"), "private.png", png(4303))
    # The client sends the path as it is, as a crafted request can: not the file, uploaded anew as Bob's.
    monkeypatch.setattr(Endpoint, "_upload_file", lambda endpoint, file, data_index: file)
    named = {"text": "What is in this picture?", "files": [handle_file(adas)]}
    bob = Client(page.url, auth=("bob", USERS["bob"]), verbose=False)
    refused, *_ = bob.predict(named, "", api_name="/chat")
    assert refused == {"role": "assistant", "content": "private.png: file not found",
                       "metadata": {"title": ERROR_TITLE}, "options": []}
    ada = Client(page.url, auth=("ada", USERS["ada"]), verbose=False)
    (reply, metrics), *_ = ada.predict(named, "", api_name="/chat")
    assert metrics["metadata"]["title"] == "Metrics" and "1 encoded" in metrics["content"]


def test_a_file_named_in_a_message_is_checked_against_the_users_own_folder(tmp_path):
    uploads = tmp_path / "uploads"
    adas = uploads / f"user-{hashlib.sha256(b'ada').hexdigest()}" / "0123" / "private.png"
    check_own(str(adas), uploads, "ada")
    check_own(str(uploads / "reply-1.wav"), uploads, "bob")  # the app's own file beside the users' folders
    with pytest.raises(RequestError, match="^private.png: file not found$"):
        check_own(str(adas), uploads, "bob")
    with pytest.raises(RequestError, match="^private.png: file not found$"):
        check_own(f"{uploads}/user-x/../{adas.relative_to(uploads)}", uploads, "bob")
