"""Saved chats on disk: private JSON files, most recent first, and nothing else read as a chat."""

import pytest

from omni_local.ui.chats import ChatShelves, ChatStore, SavedChat, first_question
from omni_local.ui.history import ChatMemory
from omni_local.ui.sidebar import ChatChangedElsewhere, clear, delete, keep


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

    store = ChatStore(tmp_path / "chats")
    warnings = []
    monkeypatch.setattr(gr, "Warning", warnings.append)
    monkeypatch.setattr(store, "save", lambda chat: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    keep(store, [{"role": "user", "content": ["Hi"]}], "", ChatMemory())
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
    delete(store, uploads, ChatMemory(session_id=chat.id))
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
    store, left, opened = ChatStore(tmp_path / "chats"), ChatMemory(), ChatMemory()
    history = [{"role": "user", "content": ["Count to a thousand."]}]
    keep(store, history, "", left, shown_id=left.session_id)  # the first question of a new chat is saved
    keep(store, history + [{"role": "assistant", "content": "One, two"}], "", opened, shown_id=left.session_id)
    assert [chat_id for _, chat_id in store.titles()] == [left.session_id]
    keep(store, [{"role": "user", "content": ["Hello?"]}], "", opened, shown_id=opened.session_id)
    assert store.get(opened.session_id).history == [{"role": "user", "content": ["Hello?"]}]


def test_a_deleted_chat_is_not_saved_again_by_a_reply_that_finishes_after(tmp_path):
    store, memory = ChatStore(tmp_path / "chats"), ChatMemory()
    history = [{"role": "user", "content": ["Hello?"]}]
    keep(store, history, "", memory)
    delete(store, tmp_path / "uploads", memory)
    keep(store, history + [{"role": "assistant", "content": "Hi."}], "", memory)
    assert store.titles() == []


@pytest.mark.parametrize("fields", [
    {"history": "oops"},
    {"history": [{"role": "system", "content": "x"}]},
    {"history": [["user", "hi"]]},
    {"replies": {"Hi.": "1, 2"}},
    {"replies": {"Hi.": [1.5]}},
    {"title": 7},
    {"updated": "yesterday"},
    {"no_such_field": 1},
])
def test_a_saved_chat_of_the_wrong_shape_is_skipped_with_a_warning_and_the_others_load(tmp_path, fields, caplog):
    import json

    good = SavedChat(history=[{"role": "user", "content": ["Fine"]}])
    ChatStore(tmp_path / "chats").save(good)
    bad = {**{k: v for k, v in vars(SavedChat()).items()}, **fields}
    (tmp_path / "chats" / f"{bad['id']}.json").write_text(json.dumps(bad))
    store = ChatStore(tmp_path / "chats")  # what the UI opens at start-up
    assert [chat.id for chat in store.all()] == [good.id] and store.titles() == [("Fine", good.id)]
    assert store.get(bad["id"]) is None
    assert any("saved chat" in record.message and "skipped" in record.message for record in caplog.records)


def test_a_chat_begun_with_files_alone_is_named_after_the_first(tmp_path):
    clip = {"path": str(tmp_path / "birdsong at dawn.wav")}
    assert SavedChat(history=[{"role": "user", "content": [clip]}]).shown_title == "birdsong at dawn.wav"


def test_a_title_is_the_first_question_on_one_line_and_a_voice_chat_is_named_by_its_time(tmp_path):
    two_lines = SavedChat(history=[{"role": "user", "content": ["What is\nthis  thing?"]}])
    assert two_lines.shown_title == "What is this thing?"
    utterance = {"path": str(tmp_path / "voice-1f2e.wav")}
    spoken = SavedChat(history=[{"role": "user", "content": [utterance]}], created=0.0)
    assert spoken.shown_title.startswith("Voice chat, ") and spoken.shown_title[-5:-3].isdigit()


def test_a_page_that_missed_another_tabs_save_cannot_save_over_it(tmp_path):
    store = ChatStore(tmp_path / "chats")
    first_tab = ChatMemory()
    keep(store, [{"role": "user", "content": ["Hi"]}], "", first_tab)
    second_tab = ChatMemory(session_id=first_tab.session_id, revision=first_tab.revision)
    asked_in_first = [{"role": "user", "content": ["Hi"]}, {"role": "assistant", "content": "Hello."},
                      {"role": "user", "content": ["How are you?"]}]
    keep(store, asked_in_first, "", first_tab)
    with pytest.raises(ChatChangedElsewhere):
        keep(store, [{"role": "user", "content": ["Hi"]}, {"role": "user", "content": ["Other"]}], "", second_tab)
    assert store.get(first_tab.session_id).history == asked_in_first


def test_with_logins_each_user_has_a_chats_folder_of_their_own(tmp_path):
    shelves = ChatShelves(tmp_path / "chats")
    ada, alan = shelves.of("ada"), shelves.of("alan")
    chat = SavedChat(history=[{"role": "user", "content": ["Secret"]}])
    ada.save(chat)
    assert alan.titles() == [] and alan.get(chat.id) is None
    assert shelves.of(None).titles() == [] and shelves.of("ada") is ada
    assert ada.folder.parent == tmp_path / "chats" and ada.folder.stat().st_mode & 0o777 == 0o700
    assert "ada" not in ada.folder.name  # named by a digest: any user name, never a path


def test_a_cleared_chat_is_not_kept_and_its_files_go(tmp_path):
    store, uploads = ChatStore(tmp_path / "chats"), tmp_path / "uploads"
    uploads.mkdir()
    spoken = uploads / "reply-1.wav"
    spoken.write_bytes(b"x")
    memory = ChatMemory()
    keep(store, [{"role": "user", "content": ["Hi"]}, {"role": "assistant", "content": [{"path": str(spoken)}]}],
         "", memory)
    clear(store, uploads, memory)
    assert store.titles() == [] and not spoken.exists()
    keep(store, [{"role": "user", "content": ["Again"]}], "", memory)  # the page goes on in the emptied chat
    assert store.get(memory.session_id).history == [{"role": "user", "content": ["Again"]}]


def test_a_failed_save_leaves_no_staging_file_and_the_chat_as_it_was(tmp_path, monkeypatch):
    import json as json_module

    store = ChatStore(tmp_path / "chats")
    chat = SavedChat(history=[{"role": "user", "content": ["Kept"]}])
    store.save(chat)
    monkeypatch.setattr(json_module, "dump", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "No space left")))
    chat.history = [{"role": "user", "content": ["Lost"]}]
    with pytest.raises(OSError):
        store.save(chat)
    assert [p.name for p in store.folder.iterdir()] == [f"{chat.id}.json"]
    assert store.get(chat.id).history == [{"role": "user", "content": ["Kept"]}] and store.get(chat.id).revision == 1


def test_each_page_gets_a_new_chat_memory_of_its_own_and_no_start_up_event_of_gradios_sets_it(app, tmp_path):
    import copy

    import gradio as gr

    from omni_local.ui.chat import build_ui

    default = ChatMemory()
    pages = [copy.deepcopy(default) for _ in range(2)]  # what gr.State does for each page
    assert len({default.session_id, *(page.session_id for page in pages)}) == 3
    used = ChatMemory(replies={"Hi.": [1]}, revision=3)
    assert copy.deepcopy(used) == used
    memories = [block for block in build_ui(app, tmp_path / "chats").blocks.values()
                if isinstance(block, gr.State) and isinstance(block.value, ChatMemory)]
    # Gradio would set a callable default in a page-load event of its own, racing the page's start-up.
    assert len(memories) == 1 and memories[0].load_event_to_attach is None


def test_the_longest_reply_the_page_offers_fits_after_the_longest_prompt(app, tmp_path):
    import gradio as gr

    from omni_local.ui.chat import build_ui

    sliders = [block for block in build_ui(app, tmp_path / "chats").blocks.values()
               if isinstance(block, gr.Slider) and block.label == "Longest reply (tokens)"]
    assert len(sliders) == 1
    assert sliders[0].maximum + app.settings.max_prompt_tokens == app.settings.max_context_tokens


def test_a_chats_context_use_is_that_of_its_last_counted_turn_also_after_an_undo():
    one = [{"role": "user", "content": ["One"]}, {"role": "assistant", "content": "A"}]
    two = [*one, {"role": "user", "content": ["Two"]}, {"role": "assistant", "content": "B"}]
    chat = SavedChat()
    chat.update(one, 30)
    chat.update([*two[:3]], None)  # turn two asked, its reply streaming: not counted yet
    assert chat.context_tokens == 30
    chat.update(two, 70)
    assert (chat.context_tokens, chat.turn_contexts) == (70, [30, 70])
    chat.update(one, None)  # turn two undone
    assert (chat.context_tokens, chat.turn_contexts) == (30, [30])
    chat.update([], None)
    assert chat.context_tokens == 0
