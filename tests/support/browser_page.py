"""Driving the chat page in a real browser, for the browser tests: Playwright and Debian's Chromium,
headless, against a served app (each test module has its own `served` fixture, which `open_tab`
opens).

The page may reach nothing but 127.0.0.1: every other request is refused, and a test fails if the
page asked for one, so each test also shows the app works offline. The microphone is Chromium's
fake device, playing tests/support/data/speech.wav and a pause, over and over. Each step's
screenshot is written to test-artifacts/browser/<test>/ (git-ignored), to look at.

Without /usr/bin/chromium or the playwright package these tests skip, unless
OMNI_LOCAL_BROWSER_TESTS=required (CI), where that is a failure. Never `playwright install`: it
downloads browsers from a host these machines cannot reach.
"""

import base64
import inspect
import json
import mimetypes
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile

from omni_local.ui.messages import block_text, blocks, file_path
from served_app import REPO, ServedApp

try:
    from playwright.sync_api import Browser, Page, sync_playwright
except ImportError:  # checked, with a clear reason, by the `browser` fixture
    sync_playwright = None

CHROMIUM = Path("/usr/bin/chromium")
SPEECH_WAV = REPO / "tests" / "support" / "data" / "speech.wav"
ARTIFACTS = REPO / "test-artifacts" / "browser"
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-dev-shm-usage",
    # The microphone: Chromium's fake device (its file is given at launch), allowed without asking.
    "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
    "--autoplay-policy=no-user-gesture-required",
    # Chromium's own traffic (updates, sync, field trials): without these it tries many connections.
    "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
    "--disable-quic",
]
STEP_TIMEOUT_MS = 60_000  # any one step: a reply, an upload, a page load (the CPU is shared)
# A finished (or stopped) reply's metrics note, by its one part every such note shows: its time to
# first token, "TTFT 3.2 ms", "TTFT 17 ms" or "TTFT 1.2 s" (a slow CPU).
METRICS = re.compile(r"TTFT [\d.,]+ m?s\b")
DESKTOP = {"width": 1280, "height": 900}
CHAT_LIST_ITEMS = "#chat-list label"  # the sidebar's saved chats, one a row (a radio group)
SHOWN_CHAT = "#chat-list label.selected"
PHONE = {"width": 390, "height": 844}

# A function body run in the page: the <audio> elements under `root`, inside shadow roots too
# (Gradio's audio player keeps its element in one).
AUDIO_ELEMENTS_JS = """
const audioElements = (root) => {
  const found = [];
  const walk = (node) => node.querySelectorAll("*").forEach((element) => {
    if (element.tagName === "AUDIO") found.push(element);
    if (element.shadowRoot) walk(element.shadowRoot);
  });
  walk(root);
  return found;
};
"""
# A function body run in the page: how many bot messages hold a finished reply's metrics.
METRICS_COUNT_JS = """
const metricsCount = (pattern) => [...document.querySelectorAll('[data-testid=bot]')].filter(
  (message) => new RegExp(pattern).test(message.getAttribute('aria-label'))).length;
"""
# A function body run in the page: the last question's text, and the bot messages under it.
LAST_TURN_JS = """
const lastTurn = () => {
  const messages = [...document.querySelectorAll('[data-testid=user], [data-testid=bot]')];
  const asked = messages.findLastIndex((message) => message.dataset.testid === 'user');
  return {question: messages[asked]?.getAttribute('aria-label').replace(/^user's message: /, ''),
          replies: messages.slice(asked + 1)};
};
"""
# Run in the page: whether the last question's reply has ended (its metrics note shows under it).
ANSWERED_JS = f"""([pattern]) => {{ {LAST_TURN_JS}
  return lastTurn().replies.some((message) => new RegExp(pattern).test(message.getAttribute('aria-label')));
}}"""
# Before the page's own scripts: when the page's Web Audio player (omni_local/ui/player.py)
# schedules each buffer, in the page's clock, so the test can tell when it reaches the speakers.
RECORD_AUDIO_STARTS_JS = """
window.omniLocalStarts = [];
const originalStart = AudioBufferSourceNode.prototype.start;
AudioBufferSourceNode.prototype.start = function (when = 0, ...rest) {
  window.omniLocalStarts.push({context: this.context, when: Math.max(when, this.context.currentTime),
                               at: performance.now()});
  return originalStart.call(this, when, ...rest);
};
"""


@pytest.fixture(scope="module")
def browser(tmp_path_factory) -> Iterator["Browser"]:
    missing = [reason for reason, absent in [
        ("the playwright package is not installed (pip install playwright)", sync_playwright is None),
        (f"no Chromium at {CHROMIUM} (apt-get install chromium)", not CHROMIUM.exists()),
    ] if absent]
    if missing:
        if os.environ.get("OMNI_LOCAL_BROWSER_TESTS") == "required":
            pytest.fail(f"browser tests are required, but {'; '.join(missing)}")
        pytest.skip(f"browser tests need a browser: {'; '.join(missing)}")
    # Speech, then 1.5 s of silence: the pause ends an utterance in voice mode. The device plays it
    # over and over.
    speech, rate = soundfile.read(SPEECH_WAV, dtype="float32")
    microphone = tmp_path_factory.mktemp("microphone") / "speech-then-pause.wav"
    soundfile.write(microphone, np.concatenate([speech, np.zeros(rate * 3 // 2, np.float32)]), rate, subtype="PCM_16")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                             args=[*CHROMIUM_ARGS, f"--use-file-for-fake-audio-capture={microphone}"])
        yield browser
        browser.close()


@pytest.fixture
def open_tab(browser, served, artifacts) -> Iterator[Callable[..., "Page"]]:
    """open_tab(viewport) opens the chat page in a fresh tab (its own context, as another browser
    would be; microphone allowed) and waits for its start-up; the tabs close after the test, each
    shown last as test-artifacts/browser/<test>/last-tab-N.png (what a failed step left)."""
    opened = []

    def open_one(viewport: dict[str, int] = DESKTOP) -> "Page":
        context = browser.new_context(viewport=viewport, permissions=["microphone"])
        context.set_default_timeout(STEP_TIMEOUT_MS)
        refused, errors = [], []

        def only_this_machine(route):
            if route.request.url.startswith("http://127.0.0.1:"):
                route.continue_()
            else:
                refused.append(route.request.url)
                route.abort()

        context.route("**/*", only_this_machine)
        context.add_init_script(RECORD_AUDIO_STARTS_JS)
        tab = context.new_page()
        tab.on("pageerror", lambda error: errors.append(str(error)))
        opened.append((context, refused, errors))
        open(tab, served)
        return tab

    yield open_one
    for number, (context, refused, errors) in enumerate(opened, 1):
        context.pages[0].screenshot(path=artifacts / f"last-tab-{number}.png", full_page=True)
        context.close()
        assert not refused, f"the page asked for something outside this machine: {refused}"
        assert not errors, f"the page's scripts failed: {errors}"


@pytest.fixture
def page(open_tab) -> "Page":
    """A tab on the chat page, showing a new chat."""
    tab = open_tab()
    new_chat(tab)
    return tab


@pytest.fixture
def artifacts(request) -> Path:
    """test-artifacts/browser/<test>/, emptied."""
    folder = ARTIFACTS / request.node.name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


@pytest.fixture
def shot(page, artifacts) -> Callable[..., None]:
    """shot("step") writes the page (or `tab`, another one) as it is now to
    test-artifacts/browser/<test>/NN-step.png."""
    folder, count = artifacts, iter(range(1, 100))

    def take(step: str, tab: "Page" = page) -> None:
        tab.wait_for_timeout(300)  # Gradio draws a finished message's folded parts a moment later
        tab.screenshot(path=folder / f"{next(count):02d}-{step}.png", full_page=True)

    return take


def assert_each_chunk_played_as_it_came(page: "Page") -> None:
    """The spoken reply's chunks reached the page in order, each went to the page's Web Audio
    player as it came, and the player's clock runs (it plays)."""
    chunks = page.evaluate("window.omniLocalChunks || []")
    assert [chunk["index"] for chunk in chunks] == list(range(len(chunks))) and chunks, chunks
    player = page.evaluate("() => ({state: window.omniLocalPlayer.context.state, scheduled: window.omniLocalStarts"
                           ".filter((start) => start.context === window.omniLocalPlayer.context).length})")
    assert player == {"state": "running", "scheduled": len(chunks)}


def play_spoken_reply_again(page: "Page") -> None:
    """Click Play on the chat's spoken reply, kept to play again, and wait until it sounds."""
    spoken = page.locator("[data-testid=bot]").filter(has_text="Spoken reply")
    unfold(spoken)
    spoken.get_by_role("button", name="Play").click()
    page.wait_for_function(f"(root) => {{ {AUDIO_ELEMENTS_JS} return audioElements(root).some("
                           "(audio) => !audio.paused && audio.currentTime > 0); }",
                           arg=spoken.element_handle(), polling=20)


def window_chunks_in_order(page: "Page") -> bool:
    """The page's player got the reply's chunks numbered 0, 1, ... (a voice turn may have been cut
    by the next one, which starts again at 0)."""
    indices = [chunk["index"] for chunk in page.evaluate("window.omniLocalChunks")]
    return indices[0] == 0 and all(b in (a + 1, 0) for a, b in zip(indices, indices[1:]))


# Helpers


def open(page: "Page", served: ServedApp) -> None:
    page.goto(served.url)
    wait_for_start(page, served)


def reload(page: "Page", served: ServedApp) -> None:
    page.reload()
    wait_for_start(page, served)


def wait_for_start(page: "Page", served: ServedApp) -> None:
    """Wait for the page's start-up event: it lists the saved chats, if any, as it shows one."""
    message_box(page).wait_for()
    if any((served.cache_dir / "chats").glob("*.json")):
        page.locator(CHAT_LIST_ITEMS).first.wait_for(state="attached")


def new_chat(page: "Page") -> None:
    page.get_by_role("button", name="New chat").click()
    page.wait_for_function(f"() => !document.querySelector('[data-testid=user], [data-testid=bot], {SHOWN_CHAT}')")


def message_box(page: "Page"):
    # Not by its placeholder: Gradio drops it once the first question is sent.
    return page.locator(".multimodal-textbox textarea")


def ask(page: "Page", text: str) -> None:
    box = message_box(page)
    box.fill(text)
    box.press("Enter")


def wait_for_metrics(page: "Page", count: int) -> str:
    """Wait until `count` replies have ended (each ends with its metrics); the last metrics line."""
    page.wait_for_function(f"([pattern, count]) => {{ {METRICS_COUNT_JS} return metricsCount(pattern) >= count; }}",
                           arg=[METRICS.pattern, count])
    return last_metrics(page)


def wait_for_answer(page: "Page") -> str:
    """Wait until the last question's reply has ended (its metrics show under it); the metrics line."""
    page.wait_for_function(ANSWERED_JS, arg=[METRICS.pattern])
    return last_metrics(page)


def last_metrics(page: "Page") -> str:
    return [text for text in bot_texts(page) if METRICS.search(text)][-1]


def bot_texts(page: "Page") -> list[str]:
    return [text for who, text in shown_messages(page) if who == "bot"]


def shown_messages(page: "Page") -> list[tuple[str, str]]:
    """The chat as shown: (who, text) per message. The text is each message's label, which holds it
    whole even while Gradio shows a titled message (metrics, an error) folded."""
    labels = page.locator("[data-testid=user], [data-testid=bot]").evaluate_all(
        "(messages) => messages.map((m) => [m.dataset.testid, m.getAttribute('aria-label')])")
    return [(who, re.sub(r"^\w+'s message: ", "", label)) for who, label in labels]


def unfold(message) -> None:
    """Open a titled message Gradio shows folded."""
    folded = message.locator(".title:not(.expanded)")
    if folded.count():
        folded.first.click()


def watch_first_reply(page: "Page") -> None:
    """From now on, the first reply's text each time it changes, until its metrics appear."""
    page.evaluate("""([pattern]) => {
      window.omniLocalSeen = [];
      const timer = setInterval(() => {
        const labels = [...document.querySelectorAll('[data-testid=bot]')].map((m) => m.getAttribute('aria-label'));
        if (labels.some((label) => new RegExp(pattern).test(label))) return clearInterval(timer);
        const text = labels[0]?.replace(/^\\w+'s message: /, '');
        if (text && text !== window.omniLocalSeen.at(-1)) window.omniLocalSeen.push(text);
      }, 10);
    }""", [METRICS.pattern])


def wait_for_streaming_recorder(page: "Page") -> None:
    """Gradio's streaming microphone loads its WAV recorder (three `module-*.js` scripts, a
    MediaRecorder polyfill and its encoder) after it appears; a Record click before that fails in
    the page ("... is not a constructor") and nothing streams. Seen in a fresh CI run."""
    page.wait_for_function("() => performance.getEntriesByType('resource').filter("
                           "(entry) => /\\/module-[\\w-]+\\.js$/.test(entry.name)).length >= 3")
    page.wait_for_timeout(1000)  # then it registers the encoder, in a worker it starts


def open_sidebar(page: "Page") -> None:
    """Open the sidebar (a phone's page starts with it closed)."""
    if not page.locator(".sidebar.open").count():
        page.get_by_role("button", name="Toggle Sidebar").click()
        page.locator(".sidebar.open").wait_for()


def open_settings(page: "Page") -> None:
    """Open the sidebar's Settings, the chat's own (every page has the reply length among them)."""
    open_sidebar(page)
    if not page.get_by_label("number input for Longest reply (tokens)").is_visible():
        page.locator("#chat-settings").get_by_text("Settings", exact=True).click()
        page.get_by_label("number input for Longest reply (tokens)").wait_for()


def set_longest_reply(page: "Page", tokens: int) -> None:
    open_settings(page)
    number = page.get_by_label("number input for Longest reply (tokens)")
    slider = page.get_by_label("range slider for Longest reply (tokens)")
    # Once in a while (a busy CPU, right after the page's start-up events) the slider went back to
    # its default just after being set: set it until it stays.
    for _ in range(5):
        number.fill(str(tokens))
        number.blur()
        page.wait_for_timeout(500)
        if slider.input_value() == str(tokens):
            return
    pytest.fail(f"the Longest reply slider would not stay at {tokens}")


def set_speak_replies(page: "Page") -> None:
    open_settings(page)
    page.get_by_label("Speak replies").check()


def choose_chat(page: "Page", title: str) -> None:
    """Open the chat listed as `title` in the sidebar."""
    open_sidebar(page)
    page.locator(CHAT_LIST_ITEMS).filter(has=page.get_by_text(title, exact=True)).click()


def listed_chats(page: "Page") -> list[str]:
    """The titles the sidebar's list shows (the search may hide some), top to bottom."""
    return page.locator(CHAT_LIST_ITEMS).evaluate_all(
        "(items) => items.filter((item) => item.checkVisibility()).map((item) => item.innerText.trim())")


def search_chats(page: "Page", query: str) -> None:
    """Type `query` in the sidebar's search box, and wait until the list shows what it found."""
    open_sidebar(page)
    page.locator("#chat-search").get_by_role("textbox").fill(query)
    page.locator(f"#chat-list[data-searched={json.dumps(query)}]").wait_for(state="attached")


def drop_file(page: "Page", path: Path, mime_type: str) -> None:
    """Drag `path` from outside the browser and drop it on the message box, as a person would."""
    transfer = page.evaluate_handle(
        """([name, data, type]) => {
          const transfer = new DataTransfer();
          const bytes = Uint8Array.from(atob(data), (c) => c.charCodeAt(0));
          transfer.items.add(new File([bytes], name, {type}));
          return transfer;
        }""",
        [path.name, base64.b64encode(path.read_bytes()).decode("ascii"), mime_type],
    )
    box = message_box(page)
    for event in ("dragenter", "dragover", "drop"):
        box.dispatch_event(event, {"dataTransfer": transfer})


def attach_file(page: "Page", path: Path) -> None:
    """Choose `path` as a person does: the clip on the message box, then the browser's file picker;
    and wait until the box shows it."""
    attached = page.locator(".multimodal-textbox .thumbnail-item")
    before = attached.count()
    with page.expect_file_chooser() as chooser:
        page.locator(".multimodal-textbox").get_by_role("button", name="Upload").click()
    chooser.value.set_files(path)
    page.wait_for_function("(count) => document.querySelectorAll('.multimodal-textbox .thumbnail-item').length > count",
                           arg=before)


def context_use(page: "Page") -> str:
    """The shown chat's context use as the page says it ("Context: 28 of 8,192 tokens"), "" if none."""
    return page.locator("#context-use").inner_text().strip()


def start_voice_mode(page: "Page") -> None:
    """Voice conversation, hands-free (its default): the microphone on."""
    page.get_by_role("button", name=re.compile(r"^Voice conversation")).click()
    wait_for_streaming_recorder(page)
    page.locator("#voice-microphone").get_by_role("button", name="Record").click()


def stop_voice_mode(page: "Page") -> None:
    page.locator("#voice-microphone").get_by_role("button", name="Stop").click()


def wait_for_reply_to_start(page: "Page", question: str) -> None:
    """Wait until `question`, asked last, has the start of its reply under it."""
    page.wait_for_function(f"""([question]) => {{ {LAST_TURN_JS} const turn = lastTurn();
      return turn.question === question && turn.replies.some((message) => message.innerText.length > 0); }}""",
                           arg=[question])


def wait_for_note(page: "Page", title: str, text: str) -> str:
    """Wait until a bot message titled `title` (a folded note: "Metrics", "Error") holds `text`; its text."""
    note = page.locator("[data-testid=bot]").filter(has=page.locator(".title", has_text=title)).filter(has_text=text)
    note.last.wait_for(state="attached")
    return re.sub(r"^\w+'s message: ", "", note.last.get_attribute("aria-label"))


def stop(page: "Page") -> str:
    """Stop the reply streaming now; the "stopped" metrics note it ends with."""
    assert not page.evaluate(ANSWERED_JS, [METRICS.pattern]), "the reply ended before it could be stopped"
    # Every streamed update redraws the button, so Playwright's click never finds it still: a direct click.
    page.get_by_role("button", name="Stop", exact=True).dispatch_event("click")
    page.get_by_role("button", name="Submit", exact=True).wait_for()
    note = wait_for_note(page, "Metrics", "stopped")
    page.wait_for_timeout(500)  # Gradio's cancel of the reply's event lands by now
    # Gradio marks the outputs of an event it cancels "Error" (a box with its own Clear button),
    # shown where they show progress: a stopped reply is no error. (Outputs that show no progress
    # keep the box in the page, hidden: what counts is what the user sees.)
    failed = page.locator(".clear-status:visible").count()
    assert not failed, f"after the stop, {failed} of the page's outputs show Gradio's error box"
    return note


def answered_again(page: "Page", action: Callable[[], None]) -> None:
    """Do `action` (an edit, a retry) and wait until it took the last reply away and a new one ended
    (which may read as the old one did: watched in the page, so that no step is missed)."""
    page.evaluate(f"""([pattern]) => {{
      {METRICS_COUNT_JS}
      const before = metricsCount(pattern);
      let taken = false;
      window.omniLocalAnsweredAgain = false;
      const timer = setInterval(() => {{
        const now = metricsCount(pattern);
        taken ||= now < before;
        if (taken && now >= before) {{ window.omniLocalAnsweredAgain = true; clearInterval(timer); }}
      }}, 10);
    }}""", [METRICS.pattern])
    action()
    page.wait_for_function("() => window.omniLocalAnsweredAgain")


def edit_retry_and_undo(page: "Page", edited: str, after: Callable[[str], None]) -> None:
    """In a chat of two turns or more: edit the last question to `edited`, retry its reply, then undo
    that turn, each step waited for, and `after(step)` run after each ("edited", "retried", "undone")."""
    answered_again(page, lambda: edit_last_question(page, edited))
    assert [text for who, text in shown_messages(page) if who == "user"][-1] == edited
    after("edited")
    answered_again(page, lambda: page.get_by_role("button", name="Retry").click())
    after("retried")
    undo(page)
    after("undone")


def undo(page: "Page") -> None:
    """The chat's Undo: the last question and its reply go."""
    asked = page.locator("[data-testid=user]").count()
    page.get_by_role("button", name="Undo").click()
    page.wait_for_function("(asked) => document.querySelectorAll('[data-testid=user]').length === asked - 1", arg=asked)


def edit_last_question(page: "Page", text: str) -> None:
    """The pencil on the last question, its new text, and the tick that confirms it."""
    page.locator("[data-testid=user]").last.hover()
    page.get_by_role("button", name="Edit").last.click()
    page.locator("textarea.edit-textarea").fill(text)
    page.locator(".message-buttons").get_by_role("button", name="Submit").click()


def clear(page: "Page") -> None:
    """The chat's trash icon."""
    page.get_by_role("button", name="Clear").click()
    page.wait_for_function("() => !document.querySelector('[data-testid=user], [data-testid=bot]')")


def rename(page: "Page", title: str) -> None:
    page.locator("#chat-title").get_by_role("textbox").fill(title)
    page.get_by_role("button", name="Rename").click()


def shown_title(page: "Page") -> str:
    """The shown chat's title, as the sidebar's list highlights it ("" for a chat not yet saved)."""
    shown = page.locator(SHOWN_CHAT)
    return shown.inner_text().strip() if shown.count() else ""


def delete_chat(page: "Page", accept: bool) -> str:
    """Press Delete and answer the page's question (yes when `accept`); the question, as "type: message"."""
    asked = []

    def answer(dialog) -> None:
        asked.append(f"{dialog.type}: {dialog.message}")
        dialog.accept() if accept else dialog.dismiss()

    page.once("dialog", answer)
    page.get_by_role("button", name="Delete").click()
    wait_until(page, lambda: asked, "Delete asked nothing")
    return asked[0]


def assert_message_box_uncovered(page: "Page") -> None:
    """The message box is on screen, and what lies at its centre is the box (no sidebar over it)."""
    box = message_box(page)
    box.wait_for()
    on_top = box.evaluate("""(box) => {
      const r = box.getBoundingClientRect();
      const onScreen = r.top >= 0 && r.left >= 0 && r.bottom <= innerHeight && r.right <= innerWidth;
      const hit = document.elementFromPoint(r.left + r.width / 2, r.top + r.height / 2);
      return {onScreen, hit: hit ? hit.outerHTML.slice(0, 120) : null, inBox: !!hit && box.contains(hit)};
    }""")
    assert on_top["onScreen"] and on_top["inBox"], f"the message box is covered or off screen: {on_top}"


def chat_files(served: ServedApp) -> dict[str, int]:
    """The saved chats' files: name -> modification time (ns)."""
    return {path.name: path.stat().st_mtime_ns for path in (served.cache_dir / "chats").glob("*.json")}


def saved_chats(served: ServedApp, earlier: Iterable[str] = ()) -> list[dict[str, Any]]:
    """The saved chats, but those in files named in `earlier`."""
    skip = set(earlier)
    return [json.loads(path.read_text()) for path in sorted((served.cache_dir / "chats").glob("*.json"))
            if path.name not in skip]


def latest_saved(served: ServedApp) -> dict[str, Any] | None:
    return max(saved_chats(served), key=lambda chat: chat["updated"], default=None)


def as_shown(history: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """A saved chat's messages as `shown_messages` reads them from the page: (who, text) per block."""
    return [("user" if message["role"] == "user" else "bot", block_as_shown(block))
            for message in history for block in blocks(message)]


def block_as_shown(block: Any) -> str:
    """Gradio's Chatbot shows a text through inspect.cleandoc (tabs expanded, the first line's
    leading space dropped), and labels a sound, a picture or a film by its kind."""
    text = block_text(block)
    if text is not None:
        return inspect.cleandoc(text)
    kind, _ = mimetypes.guess_type(file_path(block) or "")
    return f"a component of type {(kind or 'unknown').split('/')[0]}"


def wait_until_saved_as_shown(page: "Page", served: ServedApp, earlier: Iterable[str]) -> None:
    """Wait until the chats folder holds the shown chat as the page shows it: one file (besides
    those named in `earlier`, from before the test) for a chat with messages, none for an empty one."""
    def saved() -> list[list[tuple[str, str]]]:
        return [as_shown(chat["history"]) for chat in saved_chats(served, earlier)]

    def shown() -> list[list[tuple[str, str]]]:
        return [shown] if (shown := shown_messages(page)) else []

    wait_until(page, lambda: saved() == shown(),
                lambda: f"the chats folder holds {saved()}, where the page shows {shown()}")


def wait_until(page: "Page", condition: Callable[[], Any], failure: str | Callable[[], str]) -> None:
    """Wait (STEP_TIMEOUT_MS at most) until `condition()` holds, for what lies outside the page."""
    deadline = time.monotonic() + STEP_TIMEOUT_MS / 1000
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(failure() if callable(failure) else failure)
        page.wait_for_timeout(200)
