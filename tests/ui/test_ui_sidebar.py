"""The sidebar's list of chats: titles as plain text, and the search."""

import pytest

from omni_local.ui.chats import ChatStore, SavedChat
from omni_local.ui.sidebar import chooser, matching, plain


@pytest.mark.parametrize("title, shown", [
    ("**Why** is `x` so _odd_?", "Why is x so odd?"),
    ("# A heading with a [link](https://example.com)", "A heading with a link"),
    ("> a quote of ~~struck~~ text", "a quote of struck text"),
    ("- a list item with ![a picture](p.png)", "a list item with a picture"),
    ("**Bold cut short by the title's length…", "Bold cut short by the title's length…"),
    ("snake_case_names and 2*3 stay", "snake_case_names and 2*3 stay"),
])
def test_a_title_is_listed_as_plain_text(title, shown):
    assert plain(title) == shown


def test_the_list_shows_plain_titles_newest_first_with_the_shown_chat_chosen(tmp_path):
    store = ChatStore(tmp_path / "chats")
    older, newer = SavedChat(title="*Older*"), SavedChat(title="`Newer`")
    store.save(older)
    store.save(newer)
    listed = chooser(store, older.id)
    assert listed["choices"] == [("Newer", newer.id), ("Older", older.id)] and listed["value"] == older.id
    assert chooser(store, "unsaved")["value"] is None


def test_the_search_finds_chats_by_title_or_by_what_they_say_in_any_case(tmp_path):
    store = ChatStore(tmp_path / "chats")
    boats = SavedChat(history=[{"role": "user", "content": ["Boats on the **river**"]},
                               {"role": "assistant", "content": "A ferry crosses it at noon."}])
    trains = SavedChat(title="Trains",
                       history=[{"role": "user", "content": [{"path": "valley.png"}, "Where is this?"]}])
    for chat in (boats, trains):
        store.save(chat)
    assert matching(store, "river") == [boats.id]  # the title, as listed
    assert matching(store, "FERRY noon") == [boats.id]  # every word, in the reply
    assert matching(store, "where trains") == [trains.id]
    assert matching(store, "ferry trains") == []
    assert matching(store, "  ") is None  # no search: every chat is listed
