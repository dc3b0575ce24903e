"""Voice conversation: end of speech starts exactly one turn, speaking over a reply stops it, and
the desktop's microphone and speakers carry a whole turn (through a fake at sounddevice's stream
level, as these machines have no audio hardware)."""

import builtins
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
import soxr

from omni_local.api import AudioChunk, Finished, OmniLocal, Reply, Session
from omni_local.audio_devices import AudioDeviceError, Microphone, Speakers, load_sounddevice
from omni_local.cli import main
from omni_local.voice import SpeechDetector, SpeechStarted, Utterance, VoiceConversation
from samples import SILENCE, SPEECH
from waiting import until


def in_pieces(samples: np.ndarray, size: int = 1_600) -> list[np.ndarray]:
    """Audio as a microphone delivers it: 100 ms at a time."""
    return [samples[i : i + size] for i in range(0, len(samples), size)]


def detect(samples: np.ndarray) -> list:
    detector = SpeechDetector()
    return [event for piece in in_pieces(samples) for event in detector.feed(piece)]


def test_speech_then_a_second_of_silence_is_exactly_one_utterance():
    events = detect(np.concatenate([SILENCE[:8_000], SPEECH, SILENCE]))
    assert [type(e) for e in events] == [SpeechStarted, Utterance]
    assert len(SPEECH) * 0.8 < len(events[1].samples) < len(SPEECH) + 16_000


def test_silence_and_noise_are_no_utterance():
    noise = (np.random.default_rng(0).standard_normal(48_000) * 0.01).astype(np.float32)
    assert detect(np.concatenate([SILENCE, noise, SILENCE])) == []


def test_speech_without_the_pause_after_it_is_not_a_turn_yet():
    assert [type(e) for e in detect(SPEECH)] == [SpeechStarted]


class Player:
    def __init__(self) -> None:
        self.chunks: list[AudioChunk] = []
        self.stops = 0

    def play(self, chunk: AudioChunk) -> None:
        self.chunks.append(chunk)

    def stop(self) -> None:
        self.stops += 1


def conversation(app: OmniLocal, player: Player) -> tuple[VoiceConversation, list, Session]:
    shown: list = []
    session = app.session()
    talk = VoiceConversation(asking(session, max_new_tokens=8), player.play, player.stop, show=shown.append)
    return talk, shown, session


def asking(session: Session, **options: object) -> Callable[[np.ndarray], Reply]:
    """Each utterance a spoken question in `session`, the Talker greedy."""
    return lambda samples: session.send(audio=[samples], speak=True, talker_temperature=0.0, **options)


def test_an_utterance_is_answered_aloud_and_speaking_over_the_reply_stops_it(speaking_app):
    player = Player()
    talk, shown, session = conversation(speaking_app, player)
    for piece in in_pieces(np.concatenate([SPEECH, SILENCE])):
        talk.hear(piece)
    assert talk.turns == 1
    until(lambda: player.chunks, "the reply did not begin to play")
    for piece in in_pieces(np.concatenate([SPEECH, SILENCE])):  # the person speaks over it
        talk.hear(piece)
    talk.wait()
    finals = [e for e in shown if isinstance(e, Finished)]
    assert talk.turns == 2 and player.stops >= 2  # each start of speech stops the player
    assert finals[0].stop_reason == "cancelled" and finals[0].speech.audio_s < 30
    assert finals[1].tokens.prompt > finals[0].tokens.prompt  # the second question came after the first
    assert [m.role for m in session.history] == ["user", "assistant", "user", "assistant"]


class FakeSoundDevice:
    """sounddevice's stream level: streams that call their callbacks from their own threads, a
    microphone at 48 kHz playing `capture` then silence, speakers at 44.1 kHz recording what
    they are given."""

    PortAudioError = type("PortAudioError", (Exception,), {})

    def __init__(self, capture: np.ndarray, devices: bool = True) -> None:
        self.capture = soxr.resample(capture, 16_000, 48_000).astype(np.float32)
        self.devices = devices
        self.played: list[np.ndarray] = []
        fake = self

        class Stream:
            def __init__(self, samplerate, channels, dtype, callback):
                self.rate, self.callback, self.running = samplerate, callback, False

            def start(self):
                self.running = True
                threading.Thread(target=self.run, daemon=True).start()

            def stop(self):
                self.running = False

            def close(self):
                pass

        class InputStream(Stream):
            def run(self):
                block, position = self.rate // 100, 0
                while self.running:
                    data = fake.capture[position : position + block]
                    data = np.pad(data, (0, block - len(data)))[:, None]
                    self.callback(data, block, None, None)
                    position += block
                    time.sleep(0.002)  # faster than real time

        class OutputStream(Stream):
            def run(self):
                block = self.rate // 100
                while self.running:
                    out = np.zeros((block, 1), np.float32)  # only what the speakers write shows
                    self.callback(out, block, None, None)
                    fake.played.append(out[:, 0].copy())
                    time.sleep(0.001)

        self.InputStream, self.OutputStream = InputStream, OutputStream

    def query_devices(self, kind: str) -> dict:
        if not self.devices:
            raise self.PortAudioError("Error querying device -1")
        return {"default_samplerate": 48_000 if kind == "input" else 44_100}


def test_the_desktop_microphone_and_speakers_carry_a_whole_turn(speaking_app):
    device = FakeSoundDevice(np.concatenate([SILENCE, SPEECH, SILENCE, SILENCE]))
    shown: list = []
    with Speakers(device) as speakers:
        talk = VoiceConversation(asking(speaking_app.session(), max_new_tokens=4),
                                 lambda chunk: speakers.play(chunk.samples), speakers.stop, show=shown.append)
        with Microphone(device, talk.hear):
            until(lambda: talk.turns == 1, "the spoken question was not answered", 60)
            until(lambda: any(np.any(block != 0) for block in device.played), "the device played only silence", 60)
        talk.interrupt()
        talk.wait()
    assert talk.turns == 1 and not speakers.playing
    assert any(isinstance(e, Finished) for e in shown)


def test_no_audio_device_is_a_clear_error():
    device = FakeSoundDevice(SILENCE, devices=False)
    with pytest.raises(AudioDeviceError, match="no microphone to listen with: Error querying device -1"):
        Microphone(device, lambda samples: None)
    with pytest.raises(AudioDeviceError, match="no speakers to play on"):
        Speakers(device)


def test_ask_speak_without_wav_plays_the_whole_reply_on_the_speakers(demo_settings, demo_checkpoint, monkeypatch,
                                                                     capsys):
    device = FakeSoundDevice(SILENCE)
    monkeypatch.setattr("omni_local.cli.load_sounddevice", lambda: device)
    status = main(["ask", "Say hello.", "--speak", "--max-new-tokens", "6", "--max-speech-seconds", "1",
                   "--demo-dir", str(demo_settings.demo_path), "--cache-dir", demo_settings.cache_dir,
                   "--device", "cpu"])
    spoken = float(capsys.readouterr().out.rsplit(" s of speech", 1)[0].rsplit(" ", 1)[1])  # "0.8 s of speech"
    played = np.count_nonzero(np.concatenate(device.played)) / 44_100  # the speakers' rate; silence between chunks
    assert status == 0 and spoken > 0
    assert abs(played - spoken) <= 0.05 + 0.01  # all of it, before the command ended (0.05: the line's rounding)


def test_voice_without_portaudio_ends_with_one_line_and_status_2(monkeypatch, capsys):
    real_import = builtins.__import__

    def no_portaudio(name, *args, **kwargs):
        if name == "sounddevice":
            raise OSError("PortAudio library not found")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(__import__("sys").modules, "sounddevice", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_portaudio)
    with pytest.raises(AudioDeviceError):
        load_sounddevice()
    assert main(["voice", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: no audio devices: the PortAudio library is missing (PortAudio library not found); "
                   "install it (Debian: libportaudio2)")


def test_the_speakers_resample_a_reply_as_one_stream_not_chunk_by_chunk_and_play_it_to_its_end():
    speakers = Speakers(FakeSoundDevice(SILENCE))  # 44.1 kHz; never started: what it queues is read here
    tone = np.sin(2 * np.pi * 440 * np.arange(24_000) / 24_000).astype(np.float32)
    for start in range(0, len(tone), 2_400):  # a reply in 100 ms chunks
        speakers.play(tone[start : start + 2_400])
    speakers.finish()
    played = np.concatenate(list(speakers._queue.queue))
    whole = soxr.resample(tone, 24_000, 44_100)
    assert len(played) == len(whole)  # its last few ms too, which the resampler held until the end
    assert np.abs(played - whole).max() < 1e-3  # no edge at any chunk boundary
