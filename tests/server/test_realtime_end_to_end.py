"""The `openai` package's own realtime client against `python -m omni_local serve` in a subprocess,
on the demo model with speech on: spoken turns found by server VAD, each answered with audio and its
transcript, a second turn reusing the first's KV, speech over a reply cancelling it, and turns typed
and committed by hand with turn detection off.

The recorded speech is streamed in 20 ms chunks, in real time in the first test, as a microphone
sends it; the others send it as fast as the socket takes it, as the VAD reads samples, not the clock,
and finds the same starts and stops at any pace."""

import asyncio
import base64

import numpy as np
import openai
import pytest
import soxr

from samples import SILENCE, SPEECH
from served_api import served_api

CHUNK = 480  # 20 ms at 24 kHz
EVENT_TIMEOUT_S = 60
# Half a second of silence, the question, and a second of silence: one utterance to server VAD.
QUESTION = soxr.resample(np.concatenate([SILENCE[:8000], SPEECH, SILENCE]), 16_000, 24_000)
VAD = {"type": "server_vad", "silence_duration_ms": 500, "prefix_padding_ms": 300}


@pytest.fixture(scope="module")
def url(demo_settings, tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("realtime")
    with served_api(demo_settings, root, "--speech", "true", "--max-new-tokens", "12",
                    "--max-speech-seconds", "4") as served:
        yield served.url


def spoken(url: str, scenario) -> None:
    """Run `scenario(connection)` in a realtime session on `url`, audio out and server VAD on."""
    async def session() -> None:
        client = openai.AsyncOpenAI(base_url=url, api_key="no key", max_retries=0)
        async with client.realtime.connect(model="demo", max_retries=0) as connection:
            await until(connection, "session.created")
            await connection.session.update(session={"type": "realtime", "output_modalities": ["audio"],
                                                     "audio": {"input": {"turn_detection": VAD}}})
            await until(connection, "session.updated")
            await scenario(connection)

    asyncio.run(session())


async def until(connection, kind: str) -> list:
    """The server's events up to and with the first of `kind`; an error event fails the test."""
    events = []
    while not events or events[-1].type != kind:
        events.append(await asyncio.wait_for(connection.recv(), EVENT_TIMEOUT_S))
        assert events[-1].type != "error", events[-1].error
    return events


async def speak(connection, samples: np.ndarray = QUESTION, real_time: bool = False) -> None:
    pcm = np.round(np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()
    loop = asyncio.get_running_loop()
    began = loop.time()
    for index, start in enumerate(range(0, len(pcm), CHUNK * 2)):
        if real_time:  # each chunk when its 20 ms would have been recorded
            await asyncio.sleep(max(0.0, began + index * CHUNK / 24_000 - loop.time()))
        await connection.input_audio_buffer.append(audio=base64.b64encode(pcm[start:start + CHUNK * 2]).decode())


def of(events: list, kind: str) -> list:
    return [event for event in events if event.type == kind]


def audio_of(events: list) -> np.ndarray:
    """The response's audio deltas decoded: PCM16 (an even number of bytes each) at 24 kHz."""
    pieces = [base64.b64decode(event.delta) for event in of(events, "response.output_audio.delta")]
    assert pieces and all(len(piece) % 2 == 0 for piece in pieces)
    return np.frombuffer(b"".join(pieces), "<i2")


def test_a_spoken_question_is_answered_with_audio_and_its_transcript_and_the_next_turn_reuses_it(url):
    async def scenario(connection) -> None:
        await speak(connection, real_time=True)
        first = await until(connection, "response.done")
        kinds = [event.type for event in first]
        assert kinds.index("input_audio_buffer.speech_started") < kinds.index("input_audio_buffer.speech_stopped") \
            < kinds.index("input_audio_buffer.committed") < kinds.index("response.created")
        assert np.abs(audio_of(first)).max() > 0
        assert first[-1].response.model_extra["omni_local"]["first_audio_ms"] > 0  # the server's own figure
        transcript = "".join(event.delta for event in of(first, "response.output_audio_transcript.delta"))
        assert transcript and of(first, "response.output_audio_transcript.done")[0].transcript == transcript
        assert first[-1].response.output[0].content[0].transcript == transcript
        await speak(connection)
        second = await until(connection, "response.done")
        assert second[-1].response.usage.input_token_details.cached_tokens >= first[-1].response.usage.input_tokens

    spoken(url, scenario)


def test_speaking_over_a_reply_cancels_it_and_the_client_truncates_it_to_what_it_played(url):
    async def scenario(connection) -> None:
        await speak(connection)
        begun = await until(connection, "response.output_audio.delta")
        reply = of(begun, "response.output_item.added")[0].item
        await speak(connection)
        await until(connection, "input_audio_buffer.speech_started")
        # As a client does: the player stopped at once, the reply truncated to what it played.
        await connection.conversation.item.truncate(item_id=reply.id, content_index=0, audio_end_ms=40)
        events = await until(connection, "conversation.item.truncated")
        if not of(events, "response.done"):
            events += await until(connection, "response.done")
        interrupted = of(events, "response.done")[0].response
        assert (interrupted.status, interrupted.status_details.reason) == ("cancelled", "turn_detected")
        truncated = of(events, "conversation.item.truncated")[0]
        assert (truncated.item_id, truncated.audio_end_ms) == (reply.id, 40)
        answered = await until(connection, "response.done")
        assert answered[-1].response.usage.input_token_details.cached_tokens > 0

    spoken(url, scenario)


def test_with_turn_detection_off_audio_is_committed_by_hand_and_a_typed_item_answered_on_request(url):
    async def scenario(connection) -> None:
        await connection.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
        await until(connection, "session.updated")
        await speak(connection)
        await connection.input_audio_buffer.commit()
        committed = await until(connection, "input_audio_buffer.committed")
        assert not of(committed, "input_audio_buffer.speech_started")
        await connection.conversation.item.create(item={"type": "message", "role": "user",
                                                        "content": [{"type": "input_text", "text": "Say hi."}]})
        await until(connection, "conversation.item.done")
        await connection.response.create()
        answered = await until(connection, "response.done")
        assert answered[-1].response.status in ("completed", "incomplete") and len(audio_of(answered))

    spoken(url, scenario)
