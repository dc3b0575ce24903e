"""What the benchmark times: conversations whose last user turn is the timed request, and how a
run of one is sent (with the text made new for each run and chat).

Prompts follow ../shared/BENCHMARK_ANCHORS.md: a system prompt, one image or clip, a question.
"""

from dataclasses import dataclass

import numpy as np
from PIL import Image

from omni_local.api import OmniLocal, Reply, Session
from omni_local.media.video import Video
from omni_local.model.workarounds import video_supported
from omni_local.protocol.messages import Message, Part

SYSTEM = (
    "You are a helpful assistant who looks carefully at pictures and listens to sounds, then answers "
    "the question in a few clear words without guessing."
)
QUESTION = "What is in this picture, and what colour is the house?"
AUDIO_QUESTION = "What do you hear in this clip, and where was it recorded?"
VIDEO_QUESTION = "What happens in this video, and what do you hear?"
# Spoken rows ask something else, so they never reuse a text row's conversation.
SPOKEN_QUESTION = "Tell me in two sentences what you can do for me today."
HELLO = "Hello! Who are you?"
# What the other chats of a concurrent row ask instead of the row's question, one each: distinct
# users' prompts differ, so their replies and the experts they route to differ too.
OTHER_QUESTIONS = (
    "Which birds sing before sunrise, and why so early?", "How long does bread dough need to rise?",
    "What makes a violin sound different from a viola?", "Why is the sea salty but rivers are not?",
    "How do I keep basil alive on a windowsill?", "What is the difference between weather and climate?",
    "Which chess opening suits a beginner best?", "How far away is the moon, roughly, in kilometres?",
    "Why do cats purr when they are content?", "What should I pack for a two-day hike in autumn?",
    "How does a bicycle stay upright while moving?", "What was the first novel ever written?",
    "Why does ice float on water?", "How many languages are spoken in India?",
    "What is a good stretch for a stiff lower back?", "Why do leaves change colour in autumn?",
)

IMAGE_SIZES = ((224, 224), (480, 640), (1200, 1600))  # (height, width)
TURN_2_SIZES = ((480, 640), (1200, 1600))
CONCURRENCY = (1, 8, 16)  # text chat turn 2 sent by this many sessions at once
LONG_SYSTEM_TOKENS = 2084  # mstar's shared system prompt
# A prompt of one prefill chunk (the default 512 tokens, with the template and the question): what a
# chat decoding beside the long prompt's chunks waits for, each time, at most.
CHUNK_SYSTEM_TOKENS = 470
# Chats used one after another: 32 of about 1,000 tokens each (the notes, a reply, the question).
IN_TURN_CHATS, NOTES_TOKENS = 32, 900


@dataclass(frozen=True)
class Scenario:
    """A conversation whose last user turn is timed; `earlier` turns are sent first, untimed, in the
    same session (so with the cache on, their KV is there), with a fresh question text each run."""

    name: str
    system: str
    earlier: list[Message]  # user turns sent before, in the same session
    last: Message
    warm_cache: bool = False  # another session sends the same conversation first
    speak: bool = False  # every turn is a spoken reply
    concurrency: int = 1  # sessions that send the timed turn at the same time
    restart: bool = False  # the timed turn goes to a newly started app on the same cache folder
    beside: bool = False  # another chat is decoding meanwhile: its longest gap between tokens is timed too
    in_turn: int = 0  # that many sessions, opened first, send their timed turns one after another

    @property
    def first_send(self) -> bool:
        """Timed with every cache off alone: a first send has nothing to reuse, and with the cache on
        its later runs would find the earlier runs' system prompt."""
        return "first send" in self.name


def scenarios(tokenizer) -> list[Scenario]:
    images = {size: noise_image(size) for size in IMAGE_SIZES}
    ask = Message("user", [QUESTION])
    hello = Message("user", [HELLO])
    on_image = {size: Message("user", [image, QUESTION]) for size, image in images.items()}
    return [
        Scenario("text, first send", SYSTEM, [], ask),
        *(Scenario(f"image {_size(size)}, first send", SYSTEM, [], on_image[size]) for size in IMAGE_SIZES),
        *(Scenario(f"same image {_size(size)}, new question", SYSTEM, [], on_image[size], warm_cache=True)
          for size in IMAGE_SIZES),
        *(Scenario(f"image chat {_size(size)} turn 2", SYSTEM, [Message("user", [images[size], HELLO])], ask)
          for size in TURN_2_SIZES),
        Scenario("same audio 10 s, new question", SYSTEM, [], Message("user", [noise_clip(10.0), AUDIO_QUESTION]),
                 warm_cache=True),
        *(Scenario("text chat turn 2" + (f", c{n}" if n > 1 else ""), SYSTEM, [hello], ask, concurrency=n)
          for n in CONCURRENCY),
        Scenario(f"text, first send, c{CONCURRENCY[-1]}", SYSTEM, [], ask, concurrency=CONCURRENCY[-1]),
        Scenario(f"{IN_TURN_CHATS} chats of about 1,000 tokens, in turn", SYSTEM,
                 [Message("user", [notes(tokenizer, NOTES_TOKENS)])], ask, in_turn=IN_TURN_CHATS),
        Scenario(f"shared {LONG_SYSTEM_TOKENS:,}-token system prompt, new question", long_system_prompt(tokenizer),
                 [], ask, warm_cache=True),
        Scenario(f"{LONG_SYSTEM_TOKENS:,}-token system prompt, first send", long_system_prompt(tokenizer), [], ask),
        Scenario(f"{CHUNK_SYSTEM_TOKENS}-token system prompt (one chunk), first send",
                 long_system_prompt(tokenizer, CHUNK_SYSTEM_TOKENS), [], ask),
        Scenario(f"{LONG_SYSTEM_TOKENS:,}-token system prompt, first send beside a decoding chat",
                 long_system_prompt(tokenizer), [], ask, beside=True),
        # The first app asks about the image first, so with the cache on its encoder output is on disk.
        Scenario("first image 480x640 after restart", SYSTEM, [], on_image[480, 640], warm_cache=True, restart=True),
    ]


def video_scenarios() -> list[Scenario]:
    ask = Message("user", [ten_second_video(), VIDEO_QUESTION])
    return [
        Scenario("video 10 s, first send", SYSTEM, [], ask),
        Scenario("same video 10 s, new question", SYSTEM, [], ask, warm_cache=True),
    ]


def spoken_scenarios() -> list[Scenario]:
    ask = Message("user", [SPOKEN_QUESTION])
    return [
        Scenario("spoken reply, first send", SYSTEM, [], ask, speak=True),
        Scenario("voice chat turn 2", SYSTEM, [Message("user", [HELLO])], ask, speak=True),
    ]


def available(app: OmniLocal) -> list[Scenario]:
    """The scenarios `app` can serve: video where the processor reads it, speech where it speaks."""
    return (scenarios(app.backend.loaded.processor.tokenizer)
            + (video_scenarios() if video_supported(app.backend.loaded.processor) else [])
            + (spoken_scenarios() if app.backend.engine.speaker else []))


def ten_second_video() -> Video:
    """A 10 s clip as it is read (2 frames a second, 360x640) with its sound track."""
    rng = np.random.default_rng(1)
    return Video(rng.integers(0, 256, (20, 360, 640, 3), dtype=np.uint8), 2.0,
                 (rng.standard_normal(160_000) * 0.1).astype(np.float32))


def long_system_prompt(tokenizer, tokens: int = LONG_SYSTEM_TOKENS) -> str:
    """A system prompt of `tokens` tokens: numbered house rules, cut to length."""
    rules = " ".join(f"Rule {i}: describe only what the picture or the sound shows, and say when you are unsure."
                     for i in range(1, 400))
    return _cut(tokenizer, rules, tokens)


def notes(tokenizer, tokens: int) -> str:
    """A user turn of about `tokens` tokens: numbered notes, cut to length."""
    lines = " ".join(f"Note {i}: the boat left the harbour at dawn and came back before the storm." for i in range(1, 300))
    return _cut(tokenizer, lines, tokens)


def _cut(tokenizer, text: str, tokens: int) -> str:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > tokens, "the text is too short to cut"
    return tokenizer.decode(ids[:tokens])


def question(scenario: Scenario, run: int, chat: int = 0) -> Message:
    """The timed turn of `chat` (0 asks the scenario's own question; another chat of a concurrent row
    asks its own, about its own image), its text made new each run so no run is answered from an
    earlier one's cache."""
    last = scenario.last if chat == 0 else Message("user", [_chats_own(part, chat) for part in scenario.last.parts])
    return _tagged(last, f"Take {run}")


def _chats_own(part: Part, chat: int) -> Part:
    if isinstance(part, str):
        return OTHER_QUESTIONS[(chat - 1) % len(OTHER_QUESTIONS)]
    if isinstance(part, Image.Image):
        return noise_image((part.height, part.width), seed=chat)
    return part


def _tagged(message: Message, tag: str) -> Message:
    return Message("user", [p if not isinstance(p, str) else f"{tag}: {p}" for p in message.parts])


def opened(app: OmniLocal, scenario: Scenario, run: int, chat: int, new_tokens: int, speak: bool) -> Session:
    """A new session of `scenario` that has sent its earlier turns. Their text names the scenario, the
    run and the chat, so it shares no more than the system prompt with any other conversation (as
    different users' chats would), and the cache-on rows compute only the timed turn."""
    session = app.session(system_prompt=scenario.system)
    for turn in scenario.earlier:
        send(session, _tagged(turn, f"{scenario.name}, run {run}, chat {chat}"), new_tokens, speak).result()
    return session


def first_look(app: OmniLocal, scenario: Scenario, run: int, new_tokens: int) -> None:
    """Another chat sends `scenario`'s conversation first (a `warm_cache` scenario's), so the timed
    turn finds its prefix and media in the caches."""
    look = Message("user", [*scenario.last.parts[:-1], f"First look {run}."])
    send(opened(app, scenario, run, 0, new_tokens, scenario.speak), look, new_tokens, scenario.speak).result()


def send(session: Session, message: Message, new_tokens: int, speak: bool) -> Reply:
    return session.send(**_as_send(message), max_new_tokens=new_tokens, speak=speak)


def _as_send(message: Message) -> dict:
    return {"text": message.text, "images": message.images(), "audio": message.audios(), "videos": message.videos()}


def noise_image(size: tuple[int, int], seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8))


def noise_clip(seconds: float) -> np.ndarray:
    """16 kHz mono samples."""
    return (np.random.default_rng(2).standard_normal(round(16_000 * seconds)) * 0.1).astype(np.float32)


def _size(size: tuple[int, int]) -> str:
    return f"{size[0]}x{size[1]}"
