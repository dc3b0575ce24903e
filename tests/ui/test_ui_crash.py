"""A chat outlives the app's crash: `python app.py` killed (SIGKILL) while a reply streams, then
started again on the same folder, shows the question and the reply as far as it had streamed."""

import inspect
import json
from pathlib import Path

from gradio_client import Client

from served_app import served_app
from waiting import until
from omni_local.ui.chat import SAVE_EVERY_TOKENS
from omni_local.ui.messages import block_text, blocks

# The demo model's greedy reply to this does not end on its own for thousands of tokens.
ENDLESS_QUESTION = "Count to one thousand."


def saved_chats(cache_dir: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in (cache_dir / "chats").glob("*.json")]


def test_a_reply_cut_by_a_crash_is_kept_as_far_as_it_had_streamed(demo_settings, demo_checkpoint, tmp_path):
    # Saves a second apart would come too late here: the partial reply is saved by its tokens alone.
    slow_clock = ("--ui-save-every-s", "3600")
    with served_app(demo_settings, tmp_path, *slow_clock) as app:
        client = Client(app.url, verbose=False)
        job = client.submit({"text": ENDLESS_QUESTION, "files": []}, "", 2000, 0.0, 1.0, api_name="/chat")
        # Each of the reply's updates is one more token; the save of its first SAVE_EVERY_TOKENS is
        # written before the update that shows the last of them is sent.
        until(lambda: len(job.outputs()) >= SAVE_EVERY_TOKENS, "too few tokens streamed to be saved", 120)
        seen = job.outputs()[SAVE_EVERY_TOKENS - 1][0]
        app.process.kill()
        app.process.wait()
    assert isinstance(seen, str) and seen, seen
    with served_app(demo_settings, tmp_path, *slow_clock) as app:
        (chat,) = saved_chats(app.cache_dir)
        shown, *_ = Client(app.url, verbose=False).predict(chat["id"], api_name="/open_chat")
    question, reply = chat["history"]
    assert question["role"] == "user" and ENDLESS_QUESTION in json.dumps(question["content"])
    assert reply["role"] == "assistant" and reply["content"].startswith(seen), (reply, seen)
    # The page shows it as saved (Gradio's Chatbot shows a text through inspect.cleandoc).
    assert [block_text(block) for block in blocks(shown[1])] == [inspect.cleandoc(reply["content"])]
