"""How many greedy replies the caches or a batch of other chats change: the measure of the
`deterministic` setting (engine/forward/batch_invariant.py).

    python -m omni_local.bench.determinism                                     # demo model, CPU smoke run
    python -m omni_local.bench.determinism --random-weights CONFIG.json --replies 20 --deterministic true

Each case sends --replies conversations, each its own (its own picture, question or chat), greedy and
--new-tokens long, to the app with every cache on and to an app with every cache off on the same
model, and counts the timed replies whose tokens differ, with the first token where each does:
- same image, new question: a picture asked about, then a new question on it;
- text chat turn 2;
- shared system prompt: a long system prompt (--system-tokens) another chat sent first, then a new
  chat's question;
- beside 15 chats: the cache-off app's reply decoded alone, then again while 15 other chats decode
  (both sides cache off: only the batch differs);
- spoken reply: a spoken second turn, its Talker codes compared (text and codes, greedy);
- resumed from host memory: text chat turn 2, its first turn's rows moved to host memory in
  between by two long chats, in a third app whose device KV holds two conversations (the row says
  how many turns did resume from host memory).
A row says "differ" for the default setting, and must say 0 for `deterministic = true`. Both apps
share the model: --deterministic applies to both. --cases measures some of the rows only (image,
text, system, spoken, beside, host).
"""

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from PIL import Image

from omni_local.api import AudioChunk, OmniLocal, Session
from omni_local.bench.common import bench_parser, settings_and_model
from omni_local.bench.scenarios import SYSTEM, long_system_prompt, noise_image, notes
from omni_local.settings import Settings

OTHER_CHATS = 15
STARTED = time.perf_counter()
CASES = ["image", "text", "system", "spoken", "beside", "host"]  # --cases: the rows, in the table's order


@dataclass(frozen=True)
class Said:
    """A reply as compared: its tokens, and a spoken one's codec frames; its prompt's rows that came
    back from host memory."""

    tokens: list[int]
    frames: list[list[int]]
    reused_host: int = 0


def said(session: Session, new_tokens: int, text: str, images: list[Image.Image] = (), speak: bool = False) -> Said:
    reply = session.send(text, images=images, max_new_tokens=new_tokens, temperature=0.0, speak=speak,
                         talker_temperature=0.0)
    frames = [frame for event in reply if isinstance(event, AudioChunk) for frame in event.frames]
    finished = reply.result()
    return Said(finished.token_ids, frames, finished.tokens.reused_host)


# A case: (app, reply index, new tokens) -> the timed reply, sent in a session of its own.
Case = Callable[[OmniLocal, int, int], Said]


def image_new_question(app: OmniLocal, index: int, new_tokens: int) -> Said:
    session, picture = app.session(SYSTEM), noise_image((224 + 16 * index, 320))
    said(session, new_tokens, f"Picture {index}: what is in it?", [picture])
    return said(session, new_tokens, f"Picture {index}: and what colour is the sky?")


def text_turn_2(app: OmniLocal, index: int, new_tokens: int, between: Callable[[], None] = lambda: None) -> Said:
    """A chat's second reply; `between` runs after its first."""
    session = app.session(SYSTEM)
    said(session, new_tokens, f"Chat {index}: name three rivers of Europe.")
    between()
    return said(session, new_tokens, f"Chat {index}: which of them is the longest?")


def shared_system_prompt(system: str) -> Case:
    def case(app: OmniLocal, index: int, new_tokens: int) -> Said:
        said(app.session(system), new_tokens, f"Earlier chat {index}: hello.")  # the prompt's rows, cached
        return said(app.session(system), new_tokens, f"Chat {index}: which rule comes first?")
    return case


def spoken_turn_2(app: OmniLocal, index: int, new_tokens: int) -> Said:
    session = app.session(SYSTEM)
    said(session, new_tokens, f"Voice chat {index}: good morning!", speak=True)
    return said(session, new_tokens, f"Voice chat {index}: tell me about your day.", speak=True)


def resumed_from_host(small: OmniLocal, filler: str, resumed: list[int]) -> Case:
    """text_turn_2, with two chats of `filler` sent between its turns in `small` (whose KV they
    fill, so the first turn's rows move to host memory); each of small's turns 2 appends to `resumed`
    the rows it took back from host memory."""
    def fill(index: int) -> None:  # chats of their own, which no earlier reply's fillers match
        for other in range(2):
            said(small.session(SYSTEM), 1, f"Filler {index}.{other}: {filler}")

    def case(app: OmniLocal, index: int, new_tokens: int) -> Said:
        if app is not small:
            return text_turn_2(app, index, new_tokens)
        second = text_turn_2(app, index, new_tokens, between=lambda: fill(index))
        resumed.append(second.reused_host)
        return second
    return case


def two_conversations(settings: Settings, token_bytes: int) -> Settings:
    """`settings` with device KV for two conversations of max_context_tokens (and the pad block), and
    host memory for at least one."""
    rows = 2 * settings.max_context_tokens + settings.kv_block_tokens
    return settings.replace(gpu_cache_bytes=rows * token_bytes,
                            host_cache_bytes=max(settings.host_cache_bytes, rows * token_bytes))


def compared(case: Case, cached: OmniLocal, cold: OmniLocal, replies: int, new_tokens: int) -> list[int | None]:
    """For each reply: the first index where cache on and off differ (tokens, then codec frames), or None."""
    differences = []
    for index in range(replies):
        differences.append(first_difference(case(cached, index, new_tokens), case(cold, index, new_tokens)))
        progress(index, replies)
    return differences


def progress(index: int, replies: int) -> None:
    """How far a case is, on stderr: a GPU call cut by its time limit shows what it reached."""
    print(f"  reply {index + 1} of {replies} compared at {time.perf_counter() - STARTED:.0f} s", file=sys.stderr,
          flush=True)


def beside_other_chats(cold: OmniLocal, replies: int, new_tokens: int) -> list[int | None]:
    """Each reply alone, then while OTHER_CHATS chats decode long replies beside it."""
    differences = []
    for index in range(replies):
        alone = text_turn_2(cold, index, new_tokens)
        others = [cold.session(SYSTEM).send(f"Other chat {n}: count to one hundred.", max_new_tokens=4 * new_tokens,
                                            temperature=0.0) for n in range(OTHER_CHATS)]
        differences.append(first_difference(alone, text_turn_2(cold, index, new_tokens)))
        for reply in others:
            reply.cancel()
        progress(index, replies)
    return differences


def first_difference(a: Said, b: Said) -> int | None:
    for one, other in ((a.tokens, b.tokens), (a.frames, b.frames)):
        for at, (x, y) in enumerate(zip(one, other)):
            if x != y:
                return at
        if len(one) != len(other):
            return min(len(one), len(other))
    return None


def row(name: str, differences: list[int | None]) -> str:
    firsts = sorted(d for d in differences if d is not None)
    where = ", ".join(str(d) for d in firsts) or "-"
    return f"| {name} | {len(differences)} | {len(firsts)} | {where} |"


def main() -> None:
    parser = bench_parser("python -m omni_local.bench.determinism")
    parser.add_argument("--replies", type=int, default=2, help="conversations per case")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--system-tokens", type=int, default=2000, help="the shared system prompt's length")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=CASES,
                        help="the rows to measure (a GPU call's time limit may not fit all six)")
    args = parser.parse_args()
    settings, loaded = settings_and_model(args)
    every_cache_off = settings.replace(prefix_cache=False, encoder_cache=False)
    system = long_system_prompt(loaded.processor.tokenizer, args.system_tokens)
    rows: dict[str, tuple[str, Case]] = {
        "image": ("same image, new question", image_new_question), "text": ("text chat turn 2", text_turn_2),
        "system": (f"shared {args.system_tokens:,}-token system prompt", shared_system_prompt(system))}
    cases = dict(rows[key] for key in CASES if key in rows and key in args.cases)
    with OmniLocal(settings, loaded=loaded) as cached, OmniLocal(every_cache_off, loaded) as cold:
        if cached.backend.engine.speaker and "spoken" in args.cases:
            cases["spoken reply (text and codes)"] = spoken_turn_2
        print(f"deterministic = {str(settings.deterministic).lower()}, {args.new_tokens} new tokens, greedy")
        print("| case | replies | differ | first differing token of each |")
        print("| --- | --- | --- | --- |")
        for name, case in cases.items():
            print(row(f"{name}, cache on against off", compared(case, cached, cold, args.replies, args.new_tokens)),
                  flush=True)
        if "beside" in args.cases:
            print(row(f"text chat turn 2, alone against beside {OTHER_CHATS} chats",
                      beside_other_chats(cold, args.replies, args.new_tokens)), flush=True)
        if "host" not in args.cases:
            return
        small = two_conversations(settings, cached.backend.engine.runner.kv.token_bytes)
        filler = notes(loaded.processor.tokenizer, settings.max_prompt_tokens * 9 // 10)
        with OmniLocal(small, loaded=loaded) as pressed:
            resumed: list[int] = []
            differences = compared(resumed_from_host(pressed, filler, resumed), pressed, cold, args.replies,
                                   args.new_tokens)
            back = sum(1 for rows in resumed if rows > 0)
            print(row(f"text chat turn 2 resumed from host memory ({back} of {len(resumed)} did), cache on against off",
                      differences), flush=True)


if __name__ == "__main__":
    main()
