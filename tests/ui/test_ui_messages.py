"""Chat messages read alike in every form Gradio holds them: as the app makes them, and as the page
sends them back."""

from omni_local.ui.messages import block_text, blocks, file_path


def test_a_lone_block_and_a_list_of_blocks_read_as_blocks():
    assert blocks({"role": "user", "content": "Hi"}) == ["Hi"]
    assert blocks({"role": "user", "content": ["Hi", {"path": "a.png"}]}) == ["Hi", {"path": "a.png"}]
    assert blocks({"role": "assistant", "content": None}) == [None]


def test_text_is_read_from_strings_and_typed_text_blocks_and_from_nothing_else():
    assert block_text("Hi") == "Hi"
    assert block_text({"type": "text", "text": "Hi"}) == "Hi"
    assert block_text({"type": "file", "file": {"path": "a.png"}}) is None
    assert block_text({"path": "a.png"}) is None and block_text(None) is None


def test_a_file_is_read_from_each_form_gradio_gives_it_in():
    assert file_path({"path": "a.png"}) == "a.png"  # as the app makes it
    assert file_path({"type": "file", "file": {"path": "a.png"}}) == "a.png"  # as the page sends it back
    assert file_path(("a.png",)) == "a.png"  # Gradio's tuple form
    assert file_path("a.png") is None and file_path({"type": "text", "text": "a.png"}) is None
