"""Saved chats on disk: private JSON files, most recent first, and nothing else read as a chat."""

import pytest

from omni_local.ui.chats import ChatStore, SavedChat, first_question


def test_a_saved_chat_comes_back_whole_and_the_most_recent_is_listed_first(tmp_path):
    store = ChatStore(tmp_path / "chats")
    older, newer = SavedChat(system_prompt="Be brief."), SavedChat(replies={"Hi.": [1, 2]})
    older.history = [{"role": "user", "content": ["What is this?"]}]
    store.save(older)
    store.save(newer)
    assert [chat.id for chat in store.all()] == [newer.id, older.id]
    assert store.get(older.id) == older and store.get(newer.id).replies == {"Hi.": [1, 2]}


def test_chats_are_private_files_in_a_private_folder(tmp_path):
    store = ChatStore(tmp_path / "chats")
    chat = SavedChat()
    store.save(chat)
    assert store.folder.stat().st_mode & 0o777 == 0o700
    assert (store.folder / f"{chat.id}.json").stat().st_mode & 0o777 == 0o600


def test_an_unreadable_file_is_skipped_and_a_foreign_id_names_no_file(tmp_path):
    store = ChatStore(tmp_path / "chats")
    (store.folder / "broken.json").write_text("{not json")
    store.save(SavedChat())
    assert len(store.all()) == 1
    assert store.get("../../etc/passwd") is None and store.get("") is None
    with pytest.raises(ValueError):
        store.delete("../chats")


def test_a_chat_is_titled_by_its_first_question_until_renamed():
    question = [{"path": "/x.png"}, "What colour is the house in this picture?"]
    chat = SavedChat(history=[{"role": "user", "content": question}])
    assert chat.shown_title == "What colour is the house in this picture?"[:39] + "…"
    chat.title = "Houses"
    assert chat.shown_title == "Houses"
    assert first_question([]) == "" and SavedChat().shown_title == "New chat"


def test_a_chat_that_cannot_be_saved_warns_and_the_chat_goes_on(tmp_path, monkeypatch):
    import gradio as gr

    from omni_local.ui.chat import ChatMemory, _keep

    store = ChatStore(tmp_path / "chats")
    warnings = []
    monkeypatch.setattr(gr, "Warning", warnings.append)
    monkeypatch.setattr(store, "save", lambda chat: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    _keep(store, [{"role": "user", "content": ["Hi"]}], "", ChatMemory())
    assert warnings == ["This chat could not be saved: No space left on device"]


def test_a_spoken_reply_that_cannot_be_kept_warns_and_the_reply_goes_on(tmp_path, monkeypatch):
    import gradio as gr
    import numpy as np

    from omni_local.ui.history import keep_audio

    warnings = []
    monkeypatch.setattr(gr, "Warning", warnings.append)
    assert keep_audio(tmp_path / "missing" / "folder", np.zeros(2_400, np.float32)) is None
    assert warnings and warnings[0].startswith("The spoken reply could not be kept to play again")
    assert keep_audio(tmp_path, np.zeros(2_400, np.float32)).exists()


def test_deleting_a_chat_deletes_its_spoken_replies_and_voice_questions_but_not_uploads(tmp_path):
    from omni_local.ui.chat import ChatMemory, _delete

    uploads = tmp_path / "uploads"
    (uploads / "1f2e").mkdir(parents=True)
    files = {name: uploads / name for name in ("voice-1.wav", "reply-1.wav", "1f2e/photo.png")}
    for path in files.values():
        path.write_bytes(b"x")
    store = ChatStore(tmp_path / "chats")
    chat = SavedChat(history=[
        {"role": "user", "content": [{"file": {"path": str(files["voice-1.wav"])}, "type": "file"}]},
        {"role": "assistant", "content": [{"file": {"path": str(files["reply-1.wav"])}, "type": "file"}],
         "metadata": {"title": "Spoken reply"}},
        {"role": "user", "content": [{"path": str(files["1f2e/photo.png"])}, "What is this?"]},
    ])
    store.save(chat)
    _delete(store, uploads, ChatMemory(session_id=chat.id))
    assert store.get(chat.id) is None
    assert [name for name, path in files.items() if path.exists()] == ["1f2e/photo.png"]


def test_listing_the_chats_reads_no_file_and_follows_saves_and_deletes(tmp_path, monkeypatch):
    first, second = SavedChat(title="First"), SavedChat(title="Second")
    ChatStore(tmp_path / "chats").save(first)  # saved before this app's store opened the folder
    store = ChatStore(tmp_path / "chats")
    store.save(second)
    monkeypatch.setattr(ChatStore, "_read", lambda path: pytest.fail(f"{path} was read to list the chats"))
    assert store.titles() == [("Second", second.id), ("First", first.id)]
    store.delete(second.id)
    assert store.titles() == [("First", first.id)]


def test_a_change_the_page_made_before_it_opened_another_chat_is_not_saved_as_that_chat(tmp_path):
    from omni_local.ui.chat import ChatMemory, _keep

    store, left, opened = ChatStore(tmp_path / "chats"), ChatMemory(), ChatMemory()
    history = [{"role": "user", "content": ["Count to a thousand."]}]
    _keep(store, history, "", left, shown_id=left.session_id)  # the first question of a new chat is saved
    _keep(store, history + [{"role": "assistant", "content": "One, two"}], "", opened, shown_id=left.session_id)
    assert [chat_id for _, chat_id in store.titles()] == [left.session_id]
    _keep(store, [{"role": "user", "content": ["Hello?"]}], "", opened, shown_id=opened.session_id)
    assert store.get(opened.session_id).history == [{"role": "user", "content": ["Hello?"]}]


def test_a_deleted_chat_is_not_saved_again_by_a_reply_that_finishes_after(tmp_path):
    from omni_local.ui.chat import ChatMemory, _delete, _keep

    store, memory = ChatStore(tmp_path / "chats"), ChatMemory()
    history = [{"role": "user", "content": ["Hello?"]}]
    _keep(store, history, "", memory)
    _delete(store, tmp_path / "uploads", memory)
    _keep(store, history + [{"role": "assistant", "content": "Hi."}], "", memory)
    assert store.titles() == []
