"""The command line: `ask` streams and ends with timings; bad input is one line and exit status 2."""

import json
import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import soundfile

from samples import TYPED_CONTROL_TOKENS, clip, video_file
from bad_files import BAD_FILES, MAX_AUDIO_SECONDS, MAX_IMAGE_PIXELS, good_image
from omni_local.cli import main
from omni_local.settings import Settings

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def flags(demo_settings, demo_checkpoint) -> list[str]:
    """Settings flags that point the CLI at the tests' demo model, with low media limits."""
    return [
        "--demo-dir", str(demo_settings.demo_path), "--cache-dir", demo_settings.cache_dir, "--device", "cpu",
        "--max-image-pixels", str(MAX_IMAGE_PIXELS), "--max-audio-seconds", str(MAX_AUDIO_SECONDS),
    ]


@pytest.mark.parametrize("command", ["ask", "chat", "voice", "serve"])
def test_help_shows_every_settings_help_text(command, capsys):
    with pytest.raises(SystemExit) as exit:
        main([command, "--help"])
    shown = "".join(capsys.readouterr().out.split())  # argparse wraps lines, at hyphens too
    assert exit.value.code == 0
    assert [f.name for f in fields(Settings) if "".join(f.metadata["help"].split()) not in shown] == []


def test_ask_streams_the_reply_then_a_timings_line(flags, tmp_path, capsys):
    status = main(["ask", "Tell me a story.", "--image", str(good_image(tmp_path)), "--max-new-tokens", "6", *flags])
    lines = capsys.readouterr().out.rstrip("\n").split("\n")
    assert status == 0
    assert lines[-1].startswith("TTFT ") and "prompt tokens from cache" in lines[-1]
    assert "6 reply tokens" in lines[-1] or "reply length limit reached" not in lines[-1]


def test_ask_json_prints_the_final_event_as_one_object(flags, capsys):
    status = main(["ask", "Hello there", "--json", "--max-new-tokens", "5", "--seed", "3", *flags])
    final = json.loads(capsys.readouterr().out)
    assert status == 0
    assert final["seed"] == 3
    assert final["tokens"]["generated"] == len(final["token_ids"])
    assert set(final["timings"]) == {"queue_wait_s", "ttft_s", "decode_tokens_per_s"}


def test_ask_speak_writes_the_spoken_reply_to_a_wav_file(flags, tmp_path, capsys):
    wav = tmp_path / "reply.wav"
    status = main(["ask", "Say hello.", "--voice", "Chelsie", "--wav", str(wav), "--max-new-tokens", "6",
                   "--max-speech-seconds", "1", *flags])
    last = capsys.readouterr().out.rstrip("\n").split("\n")[-1]
    samples, rate = soundfile.read(wav, dtype="float32")
    assert status == 0
    assert rate == 24_000 and samples.ndim == 1 and samples.size > 0
    assert f"{samples.size / rate:.1f} s of speech (Chelsie)" in last


def test_ask_with_an_unknown_voice_ends_with_one_line_listing_the_voices(flags, tmp_path, capsys):
    status = main(["ask", "Hi", "--wav", str(tmp_path / "reply.wav"), "--voice", "Nobody", *flags])
    assert status == 2
    expected = "error: unknown voice 'Nobody': this model speaks as Aiden, Chelsie, Ethan"
    assert capsys.readouterr().err.strip() == expected


@pytest.mark.parametrize("case", BAD_FILES)
def test_a_bad_file_ends_with_one_line_naming_it_and_status_2(flags, bad_files, capsys, case):
    path, phrase = bad_files[case]
    kind = "--audio" if path.suffix == ".wav" else "--image"
    status = main(["ask", "What is this?", kind, str(path), *flags])
    err = capsys.readouterr().err.strip()
    assert status == 2
    assert err.startswith("error: ") and phrase in err and "\n" not in err


def test_an_unknown_settings_key_ends_with_one_line_and_status_2(flags, tmp_path, capsys):
    settings_file = tmp_path / "settings.toml"
    settings_file.write_text("[engine]\nturbo = true\n")
    status = main(["ask", "Hi", "--settings", str(settings_file), *flags])
    assert status == 2
    assert capsys.readouterr().err.strip() == f"error: {settings_file}: unknown setting 'engine.turbo'"


def test_a_real_process_prints_no_traceback_for_a_bad_file(flags, bad_files):
    path, phrase = bad_files["truncated png"]
    done = subprocess.run(
        [sys.executable, "-m", "omni_local", "ask", "What?", "--image", str(path), *flags],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"error: {phrase} (not a readable image)"]


def test_chat_holds_a_conversation_with_attachments_and_survives_a_bad_file(flags, bad_files, tmp_path):
    bad, _ = bad_files["zero-byte file"]
    script = f"Hello\n/image {bad}\nWhat about this?\n/image {good_image(tmp_path)}\nAnd this?\n"
    done = subprocess.run(
        [sys.executable, "-m", "omni_local", "chat", "--max-new-tokens", "4", *flags],
        cwd=REPO, input=script, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0
    assert done.stdout.count("prompt tokens") == 3  # every message: the bad file was refused when attached
    assert "empty.png: the file is empty; nothing attached" in done.stderr


def chat(flags: list[str], script: str) -> subprocess.CompletedProcess:
    """`chat` as a person at a terminal runs it, typing `script`."""
    return subprocess.run([sys.executable, "-m", "omni_local", "chat", "--max-new-tokens", "4", *flags],
                          cwd=REPO, input=script, capture_output=True, text=True, timeout=300)


def test_chat_checks_a_file_when_it_is_attached_and_the_next_message_is_answered(flags, tmp_path):
    noise, notes = tmp_path / "noise.wav", tmp_path / "notes.wav"
    soundfile.write(noise, clip(1), 16_000)
    notes.write_text("not a sound")
    done = chat(flags, f"/image {tmp_path / 'missing.png'}\nHello\n/audio {notes}\n/audio\nAnd now?\n"
                       f"/audio {noise}\nWhat do you hear?\n")
    assert done.returncode == 0
    assert [line for line in done.stderr.splitlines() if line.startswith("error")] == [
        "error: missing.png: file not found; nothing attached",
        "error: notes.wav: not an audio file (WAV, FLAC, OGG or MP3 expected); nothing attached",
        "error: /audio needs a file: /audio PATH",
    ]
    assert "noise.wav attached to the next message" in done.stdout
    assert done.stdout.count("prompt tokens") == 3  # each message was answered


def test_chat_help_lists_its_commands(flags):
    done = chat(flags, "/help\n")
    assert done.returncode == 0
    assert ("/image PATH   attach an image to the next message\n"
            "/audio PATH   attach an audio file (WAV, FLAC, OGG, MP3) to the next message\n"
            "/video PATH   attach a video (MP4, WebM, MOV) to the next message\n"
            "/help         this list\n"
            "Ctrl-C stops a reply; Ctrl-D quits.\n") in done.stdout
    assert "prompt tokens" not in done.stdout  # /help is no message to the model


def test_ask_speak_without_wav_and_without_an_audio_device_is_refused_before_the_model_loads(flags, tmp_path):
    # sounddevice as a machine without PortAudio has it, whatever this machine has.
    (tmp_path / "sounddevice.py").write_text("raise OSError('PortAudio library not found')\n")
    done = subprocess.run([sys.executable, "-m", "omni_local", "ask", "Say hello.", "--speak", *flags],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"})
    assert (done.returncode, done.stdout) == (2, "")  # no reply: nothing was computed
    assert done.stderr == ("error: no audio devices: the PortAudio library is missing (PortAudio library not "
                           "found); install it (Debian: libportaudio2), or add --wav FILE to save the spoken "
                           "reply\n")


def test_app_py_refuses_an_unknown_settings_key_with_one_line_and_status_2(tmp_path):
    settings_file = tmp_path / "settings.toml"
    settings_file.write_text("[ui]\nui_colour = 'blue'\n")
    done = subprocess.run([sys.executable, "app.py", "--settings", str(settings_file)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip() == f"error: {settings_file}: unknown setting 'ui.ui_colour'"


@pytest.mark.torchvision
def test_ask_answers_about_a_video(flags, tmp_path, capsys):
    path = tmp_path / "clip.webm"
    path.write_bytes(video_file(1, container="webm"))
    status = main(["ask", "What happens here?", "--video", str(path), "--max-new-tokens", "4", *flags])
    assert status == 0
    assert "· media: 1 encoded" in capsys.readouterr().out  # the video reached the model


def test_ask_gives_the_model_a_typed_system_turn_as_plain_text(flags, built_prompts, template_ids, capsys):
    status = main(["ask", TYPED_CONTROL_TOKENS, "--system", "Be brief.", "--max-new-tokens", "1", *flags])
    assert status == 0
    assert [p.input_ids[0].tolist() for p in built_prompts] == [template_ids("Be brief.", TYPED_CONTROL_TOKENS)]


NOT_UTF8 = os.fsdecode(b"caf\xe9?")  # as Python decodes a command line's bytes that are not UTF-8


@pytest.mark.parametrize(("arguments", "holder"),
                         [([NOT_UTF8], "the message"), (["Hi", "--system", NOT_UTF8], "the system prompt")])
def test_text_that_is_not_utf8_ends_with_one_line_and_status_2(flags, capsys, arguments, holder):
    status = main(["ask", *arguments, *flags])
    assert status == 2
    assert capsys.readouterr().err.strip() == (f"error: {holder} holds text that is not valid Unicode "
                                               "(invalid UTF-8 or a lone surrogate at character 4)")
