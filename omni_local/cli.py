"""Command line: `ask` one question, `chat` in the terminal, or talk with `voice`.

    python -m omni_local ask "What is this?" --image cat.png [--audio q.wav] [--video clip.mp4] [--system ...] [--json]
    python -m omni_local ask --audio sound.wav --model /path/to/Qwen3-Omni-30B-A3B-Captioner   # a caption
    python -m omni_local ask "Say hello." --speak [--voice Chelsie]   # played on the speakers
    python -m omni_local ask "Say hello." --wav reply.wav              # saved instead
    python -m omni_local chat [--system ...]                           # /help lists its commands
    python -m omni_local voice [--system ...] [--voice Chelsie]   # microphone and speakers
    python -m omni_local serve [--api-host ADDRESS --api-key-file FILE]   # the OpenAI-compatible API

Any setting can be overridden (`--max-new-tokens 64`, `--model /path/to/checkpoint`). A bad file or
setting ends with one line naming it and exit status 2, never a traceback. A Thinking checkpoint's
reasoning is printed dimmed before its answer on a terminal; elsewhere (a pipe, a file) only with
`--show-reasoning`.
"""

import argparse
import dataclasses
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import soundfile

from omni_local.api import OmniLocal, Reply, Session
from omni_local.audio_devices import AudioDeviceError, Microphone, Speakers, load_sounddevice
from omni_local.errors import OmniLocalError
from omni_local.media import load_audio, load_image
from omni_local.media.video import Video
from omni_local.metrics_line import metrics_line
from omni_local.protocol.events import SPEECH_SAMPLE_RATE, AudioChunk, Finished, ReasoningDelta, TextDelta
from omni_local.settings import add_settings_arguments, settings_from_arguments
from omni_local.voice import VoiceConversation

EXIT_BAD_INPUT = 2
DIM, PLAIN = "\x1b[2m", "\x1b[0m"
CHAT_HELP = """\
/image PATH   attach an image to the next message
/audio PATH   attach an audio file (WAV, FLAC, OGG, MP3) to the next message
/video PATH   attach a video (MP4, WebM, MOV) to the next message
/help         this list
Ctrl-C stops a reply; Ctrl-D quits."""
_ATTACH = {"/image": "images", "/audio": "audio", "/video": "videos"}  # chat's command -> send()'s argument


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m omni_local", description="Qwen3-Omni on your own machine")
    commands = parser.add_subparsers(dest="command", required=True)
    ask = commands.add_parser("ask", help="ask one question and stream the reply")
    ask.add_argument("question", nargs="?", default="", help="the question's text (none: the files alone)")
    ask.add_argument("--image", type=Path, action="append", default=[], help="an image file (repeatable)")
    ask.add_argument("--audio", type=Path, action="append", default=[], help="an audio file (repeatable)")
    ask.add_argument("--video", type=Path, action="append", default=[],
                     help="a video file, MP4, WebM or MOV (repeatable)")
    ask.add_argument("--json", action="store_true", help="print only the final event, as one JSON object")
    ask.add_argument("--speak", action="store_true",
                     help="a spoken reply too, played on the speakers (loads the Talker: --speech true)")
    ask.add_argument("--wav", type=Path, default=None,
                     help="write the spoken reply to this WAV file instead of playing it (implies --speak)")
    chat = commands.add_parser("chat", help="a multi-turn conversation in the terminal")
    voice = commands.add_parser("voice", help="a spoken conversation through the microphone and speakers")
    for sub in (ask, chat):
        sub.add_argument("--show-reasoning", action="store_true",
                         help="print a Thinking checkpoint's reasoning even where the output is not a terminal")
    for sub in (ask, chat, voice):
        sub.add_argument("--system", default=None, help="system prompt")
        sub.add_argument("--seed", type=int, default=None, help="random seed for sampled replies")
        add_settings_arguments(sub)
    serve = commands.add_parser("serve", help="serve OpenAI's chat API at http://api_host:api_port/v1")
    add_settings_arguments(serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from_arguments(args)
        if args.command == "serve":
            from omni_local.server.serve import serve  # FastAPI and uvicorn, which the other commands never need

            serve(settings)
            return 0
        if getattr(args, "wav", None) is not None:
            args.speak = True
        if getattr(args, "speak", False) or args.command == "voice":
            settings = settings.replace(speech=True)
        # Before the model loads: no device is refused before anything is computed.
        sounddevice = load_sounddevice() if args.command == "voice" else None
        speakers = _speakers_for_ask(args)
        with OmniLocal(settings, wait_for_graphs=False) as app:
            session = app.session(system_prompt=args.system)
            if args.command == "ask":
                return _ask(session, args, speakers)
            if args.command == "voice":
                return _voice(session, sounddevice, args)
            return _chat(app, session, args)
    except OmniLocalError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _speakers_for_ask(args: argparse.Namespace) -> Speakers | None:
    """The speakers `ask --speak` plays its reply on, where no `--wav` saves it instead."""
    if args.command != "ask" or not args.speak or args.wav is not None:
        return None
    try:
        return Speakers(load_sounddevice())
    except AudioDeviceError as error:
        raise AudioDeviceError(f"{error}, or add --wav FILE to save the spoken reply") from None


def _ask(session: Session, args: argparse.Namespace, speakers: Speakers | None) -> int:
    # The voice is the `voice` setting, so `--voice NAME` picks it like any other setting.
    reply = session.send(args.question, images=args.image, audio=args.audio, videos=args.video, seed=args.seed,
                         speak=args.speak)
    if speakers is None:
        final = _stream(reply, show_text=not args.json, show_reasoning=args.show_reasoning)
    else:
        with speakers:
            final = _stream(reply, show_text=not args.json, show_reasoning=args.show_reasoning,
                            on_audio=speakers.play)
            _play_to_the_end(speakers)
    if args.wav is not None:
        _write_wav(args.wav, reply)
    if args.json:
        print(json.dumps(dataclasses.asdict(final)))
    return 0


def _play_to_the_end(speakers: Speakers) -> None:
    """Let the speakers play what they hold (Ctrl-C stops them)."""
    speakers.finish()
    try:
        while speakers.playing:
            time.sleep(0.02)
    except KeyboardInterrupt:
        speakers.stop()


def _write_wav(path: Path, reply: Reply) -> None:
    try:
        soundfile.write(path, reply.audio, SPEECH_SAMPLE_RATE, subtype="PCM_16", format="WAV")
    except (OSError, RuntimeError) as error:  # soundfile reports an unwritable path as RuntimeError
        raise OmniLocalError(f"cannot write '{path}': {error}") from None


def _chat(app: OmniLocal, session: Session, args: argparse.Namespace) -> int:
    print("Type a message; '/image PATH', '/audio PATH' or '/video PATH' attaches a file to the next one; "
          "/help lists the commands; Ctrl-D quits.")
    attached: dict[str, list] = {kind: [] for kind in _ATTACH.values()}
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            print()
            return 0
        command, _, path = line.partition(" ")
        if command == "/help":
            print(CHAT_HELP)
        elif command in _ATTACH:
            _attach(app, command, path.strip(), attached[_ATTACH[command]])
        elif line or any(attached.values()):
            try:
                reply = session.send(line, **attached, seed=args.seed)
                _stream(reply, show_text=True, show_reasoning=args.show_reasoning)
            except OmniLocalError as error:
                print(f"error: {error}", file=sys.stderr)  # the conversation goes on
            attached = {kind: [] for kind in attached}


def _attach(app: OmniLocal, command: str, path: str, attached: list) -> None:
    """The file read and checked now, as the message will take it: a bad one is refused here, with
    nothing attached, rather than failing the next message."""
    if not path:
        print(f"error: {command} needs a file: {command} PATH", file=sys.stderr)
        return
    try:
        attached.append(_read_attachment(app, _ATTACH[command], Path(path).expanduser()))
    except OmniLocalError as error:
        print(f"error: {error}; nothing attached", file=sys.stderr)
        return
    print(f"{Path(path).name} attached to the next message")


def _read_attachment(app: OmniLocal, kind: str, path: Path) -> object:
    if kind == "images":
        return load_image(path, app.limits)
    if kind == "audio":
        return load_audio(path, app.limits)
    video = app.read_video(path)
    # A remote backend checks the file's header only; the file itself goes with the message.
    return video if isinstance(video, Video) else path


def _voice(session: Session, sounddevice: Any, args: argparse.Namespace) -> int:
    """Listen, answer aloud, listen again; speaking over a reply stops it. Use headphones: the
    microphone would otherwise hear the reply and take it for the person speaking."""
    with Speakers(sounddevice) as speakers:
        def show(event: TextDelta | Finished | OmniLocalError) -> None:
            if isinstance(event, Finished):
                speakers.finish()
            _show_voice_event(event)

        conversation = VoiceConversation(lambda samples: session.send(audio=[samples], speak=True, seed=args.seed),
                                         lambda chunk: speakers.play(chunk.samples), speakers.stop, show=show)
        with Microphone(sounddevice, conversation.hear):
            print("Listening: speak, then pause; Ctrl-C ends the conversation.")
            try:
                threading.Event().wait()
            except KeyboardInterrupt:
                conversation.interrupt()
                print()
    return 0


def _show_voice_event(event: TextDelta | Finished | OmniLocalError) -> None:
    if isinstance(event, TextDelta):
        print(event.text, end="", flush=True)
    elif isinstance(event, Finished):
        print("\n" + metrics_line(event))
    else:
        print(f"error: {event}", file=sys.stderr)


def _stream(reply: Reply, show_text: bool, show_reasoning: bool = False,
            on_audio: Callable[[np.ndarray], None] | None = None) -> Finished:
    """Print deltas as they come (and hand a spoken reply's samples to `on_audio`); Ctrl-C cancels
    the reply instead of killing the program."""
    final = None
    terminal = sys.stdout.isatty()
    reasoning = ReasoningPrinter(shown=show_text and (show_reasoning or terminal), dim=terminal)
    try:
        for event in reply:
            if isinstance(event, ReasoningDelta):
                reasoning.print(event.text)
            elif isinstance(event, TextDelta) and show_text:
                reasoning.end()
                print(event.text, end="", flush=True)
            elif isinstance(event, AudioChunk) and on_audio is not None:
                on_audio(event.samples)
            elif isinstance(event, Finished):
                final = event
    except KeyboardInterrupt:
        reply.cancel()
        final = reply.result()
    reasoning.end()
    if show_text:
        print()
        print(metrics_line(final))
    return final


class ReasoningPrinter:
    """A reply's reasoning as it streams, dimmed on a terminal, set off from the answer by a blank line."""

    def __init__(self, shown: bool, dim: bool) -> None:
        self.shown, self.dim = shown, dim
        self.open = False  # reasoning was printed and the answer has not begun

    def print(self, text: str) -> None:
        if not self.shown:
            return
        if not self.open:
            print(DIM if self.dim else "Reasoning:\n", end="")
            self.open = True
        print(text, end="", flush=True)

    def end(self) -> None:
        if self.open:
            print((PLAIN if self.dim else "") + "\n", flush=True)
            self.open = False
