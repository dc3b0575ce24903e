"""A full disk costs only what did not fit: an upload is refused in words (the page shows them), a
chat that cannot be saved raises, and neither leaves a partial file taking up the disk."""

import errno
import os

import httpx
import pytest
from gradio_client import Client, handle_file

from bad_files import good_image
from served_app import served_app
from omni_local.ui.chats import ChatStore, SavedChat

TOO_BIG = 5 << 20  # mountable's disk holds 4 MiB


def test_an_upload_the_disk_has_no_room_for_is_refused_in_words_and_leaves_nothing(
    demo_settings, demo_checkpoint, mountable, tmp_path
):
    cache = mountable / "cache"  # on the small disk; the app's log is not
    with served_app(demo_settings, tmp_path, "--cache-dir", str(cache)) as app:
        response = httpx.post(f"{app.url}gradio_api/upload", files={"files": ("noise.png", os.urandom(TOO_BIG))})
        assert (response.status_code, response.text) == (507, "the file could not be saved: No space left on device")
        assert [path.name for path in (cache / "uploads").iterdir() if path.is_file()] == []
        # The disk has its room back: the next upload and its question go through.
        upload = handle_file(str(good_image(tmp_path)))
        (reply, _), *_ = Client(app.url, verbose=False).predict({"text": "What is this?", "files": [upload]}, "",
                                                                 api_name="/chat")
        assert reply["content"] and not reply["metadata"]


def test_a_chat_the_disk_has_no_room_for_raises_and_leaves_no_partial_file(mountable):
    store = ChatStore(mountable / "chats")
    with pytest.raises(OSError) as failed:
        store.save(SavedChat(history=[{"role": "user", "content": "x" * TOO_BIG}]))
    assert failed.value.errno == errno.ENOSPC
    assert list(store.folder.iterdir()) == []
    chat = SavedChat(history=[{"role": "user", "content": "Hello"}])
    store.save(chat)
    assert store.get(chat.id) == chat
