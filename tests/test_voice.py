"""Voice conversation: end of speech starts exactly one turn, speaking over a reply stops it, and
the desktop's microphone and speakers carry a whole turn (through a fake at sounddevice's stream
level, as these machines have no audio hardware)."""

import builtins
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile
import soxr

from omni_local.api import AudioChunk, Finished, OmniLocal
from omni_local.audio_devices import AudioDeviceError, Microphone, Speakers, load_sounddevice
from omni_local.cli import main
from omni_local.voice import SpeechDetector, SpeechStarted, Utterance, VoiceConversation

# "Hello there. What do you think about the weather today?" spoken by espeak-ng
# (`espeak-ng -s 150 -w out.wav "..."`, resampled to 16 kHz): 4.0 s.
SPEECH, _ = soundfile.read(Path(__file__).parent / "data" / "speech.wav", dtype="float32")
SILENCE = np.zeros(16_000, np.float32)  # 1 s


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


@pytest.fixture(scope="module")
def app(demo_settings, demo_checkpoint):
    # Long spoken replies (the demo's Talker rarely ends on its own), so one is still playing when
    # the person speaks again.
    with OmniLocal(demo_settings.replace(speech=True, max_speech_seconds=30.0)) as running:
        yield running


class Player:
    def __init__(self) -> None:
        self.chunks: list[AudioChunk] = []
        self.stops = 0

    def play(self, chunk: AudioChunk) -> None:
        self.chunks.append(chunk)

    def stop(self) -> None:
        self.stops += 1


def conversation(app: OmniLocal, player: Player) -> tuple[VoiceConversation, list]:
    shown: list = []
    talk = VoiceConversation(app.session(), player.play, player.stop, show=shown.append, max_new_tokens=8,
                             talker_temperature=0.0)
    return talk, shown


def test_an_utterance_is_answered_aloud_and_speaking_over_the_reply_stops_it(app):
    player = Player()
    talk, shown = conversation(app, player)
    for piece in in_pieces(np.concatenate([SPEECH, SILENCE])):
        talk.hear(piece)
    assert talk.turns == 1
    _wait_for(lambda: player.chunks)  # the reply is playing
    for piece in in_pieces(np.concatenate([SPEECH, SILENCE])):  # the person speaks over it
        talk.hear(piece)
    talk.wait()
    finals = [e for e in shown if isinstance(e, Finished)]
    assert talk.turns == 2 and player.stops >= 1
    assert finals[0].stop_reason == "cancelled" and finals[0].speech.audio_s < 30
    assert finals[1].tokens.prompt > finals[0].tokens.prompt  # the second question came after the first
    assert [m.role for m in talk.session.history] == ["user", "assistant", "user", "assistant"]


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
                    out = np.ones((block, 1), np.float32)
                    self.callback(out, block, None, None)
                    fake.played.append(out[:, 0].copy())
                    time.sleep(0.001)

        self.InputStream, self.OutputStream = InputStream, OutputStream

    def query_devices(self, kind: str) -> dict:
        if not self.devices:
            raise self.PortAudioError("Error querying device -1")
        return {"default_samplerate": 48_000 if kind == "input" else 44_100}


def test_the_desktop_microphone_and_speakers_carry_a_whole_turn(app):
    device = FakeSoundDevice(np.concatenate([SILENCE, SPEECH, SILENCE, SILENCE]))
    shown: list = []
    with Speakers(device) as speakers:
        talk = VoiceConversation(app.session(), lambda chunk: speakers.play(chunk.samples), speakers.stop,
                                 show=shown.append, max_new_tokens=4, talker_temperature=0.0)
        with Microphone(device, talk.hear):
            _wait_for(lambda: talk.turns == 1, seconds=60)
            _wait_for(lambda: any(np.any(block != 0) for block in device.played), seconds=60)
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


def _wait_for(condition, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)

