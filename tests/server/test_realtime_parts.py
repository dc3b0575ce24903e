"""The realtime session's parts, without a server: its client events read and checked, the input
buffer cut into utterances by server VAD, a spoken reply's transcript cut at the audio played, and
the conversation's items as the prompt's messages."""

import base64
import json

import numpy as np
import pytest
import soxr

from omni_local.media.pcm16 import to_pcm16
from omni_local.protocol.functions import ToolCall
from omni_local.server.realtime.client_events import (AudioAppend, EventError, ItemCreate, ServerVad, SessionUpdate,
                                                      read_event)
from omni_local.server.realtime.conversation import Conversation, Item, SpokenText
from omni_local.server.realtime.input_audio import InputAudio, SpeechStart, SpeechStop, decode_pcm16
from samples import SILENCE, SPEECH

CHUNK_24K = 480  # 20 ms at 24 kHz, as a client sends
WEATHER = ToolCall("call_1", "get_weather", '{"city": "Paris"}')


def at_24k(samples: np.ndarray) -> np.ndarray:
    return soxr.resample(samples, 16_000, 24_000).astype(np.float32)


def refusal(event: dict) -> EventError:
    with pytest.raises(EventError) as refused:
        read_event(json.dumps(event))
    return refused.value


def test_a_known_event_is_read_as_its_type_with_its_fields():
    event = read_event(json.dumps({"type": "input_audio_buffer.append", "audio": "AAA=", "event_id": "e1"}))
    assert event == AudioAppend(type="input_audio_buffer.append", audio="AAA=", event_id="e1")


def test_an_unknown_event_type_is_refused_naming_it_and_the_client_events_id():
    error = refusal({"type": "session.teleport", "event_id": "e7"})
    assert error.code == "unknown_event_type" and "'session.teleport'" in error.message and error.event_id == "e7"


def test_a_message_that_is_not_a_json_object_is_refused():
    for text in ["not json", "[1, 2]"]:
        with pytest.raises(EventError, match="JSON object"):
            read_event(text)


@pytest.mark.parametrize("audio", [{"input": {"format": {"type": "audio/pcm", "rate": 16000}}},
                                   {"output": {"format": {"type": "audio/pcmu"}}}])
def test_an_audio_format_other_than_pcm16_at_24_khz_is_refused_naming_the_field(audio):
    error = refusal({"type": "session.update", "session": {"type": "realtime", "audio": audio}})
    assert error.param.startswith(f"session.audio.{next(iter(audio))}.format")


def test_semantic_vad_is_refused_and_server_vad_takes_its_settings():
    assert refusal({"type": "session.update", "session": {"audio": {"input": {"turn_detection": {
        "type": "semantic_vad"}}}}}).param.startswith("session.audio.input.turn_detection")
    event = read_event(json.dumps({"type": "session.update", "session": {"audio": {"input": {"turn_detection": {
        "type": "server_vad", "threshold": 0.6, "silence_duration_ms": 300, "prefix_padding_ms": 100}}}}}))
    assert isinstance(event, SessionUpdate)
    assert event.session.audio.input.turn_detection == ServerVad(type="server_vad", threshold=0.6,
                                                                silence_duration_ms=300, prefix_padding_ms=100)


def test_an_item_or_a_part_of_a_kind_not_served_is_refused_naming_its_place():
    assert isinstance(read_event(json.dumps({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}})), ItemCreate)
    assert refusal({"type": "conversation.item.create", "item": {"type": "mcp_call", "id": "x"}}).param == "item"
    assert refusal({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_image"}]}}).param == "item.content[0].type"


def test_bad_base64_and_an_odd_number_of_bytes_are_refused():
    with pytest.raises(EventError, match="not valid base64") as refused:
        decode_pcm16("###")
    assert refused.value.code == "invalid_base64"
    with pytest.raises(EventError, match="3 bytes"):
        decode_pcm16(base64.b64encode(b"abc").decode())


def test_pcm16_decodes_to_the_samples_sent():
    samples = np.array([0.0, 0.5, -0.25], np.float32)
    assert np.allclose(decode_pcm16(base64.b64encode(to_pcm16(samples).tobytes()).decode()), samples, atol=1e-4)


def fed(audio: InputAudio, samples_24k: np.ndarray) -> list:
    """`samples_24k` appended in 20 ms pieces, as a client streams them; the events they completed."""
    return [event for start in range(0, len(samples_24k), CHUNK_24K)
            for event in audio.append(samples_24k[start:start + CHUNK_24K])]


def test_server_vad_finds_one_utterance_in_speech_between_silences_and_commits_it_with_its_padding():
    audio = InputAudio(ServerVad(type="server_vad", silence_duration_ms=500, prefix_padding_ms=300), 300)
    events = fed(audio, at_24k(np.concatenate([SILENCE[:8000], SPEECH, SILENCE])))
    assert [type(event) for event in events] == [SpeechStart, SpeechStop]
    start, stop = events
    assert 400 <= start.audio_start_ms <= 700  # the speech begins after 500 ms of silence
    speech_ends_ms = 500 + len(SPEECH) // 16
    assert speech_ends_ms < stop.audio_end_ms <= speech_ends_ms + 500 + 100
    seconds = len(stop.samples) / 16_000  # the speech, with 300 ms before it and the 500 ms of silence after
    assert (stop.audio_end_ms - start.audio_start_ms) / 1000 < seconds < len(SPEECH) / 16_000 + 0.3 + 0.5 + 0.1


def test_without_turn_detection_the_buffer_keeps_everything_until_committed_and_a_short_one_is_refused():
    audio = InputAudio(None, 300)
    assert fed(audio, at_24k(SPEECH)) == []
    assert abs(len(audio.take()) - len(SPEECH)) <= 1 and len(audio.samples()) == 0
    fed(audio, np.zeros(CHUNK_24K * 2, np.float32))  # 40 ms
    with pytest.raises(EventError, match="at least 100 ms"):
        audio.take()


def test_with_server_vad_the_buffer_keeps_its_last_seconds_through_a_long_silence():
    audio = InputAudio(ServerVad(type="server_vad"), max_seconds=1)
    assert fed(audio, np.zeros(3 * 24_000, np.float32)) == []
    assert 15_500 <= len(audio.samples()) <= 16_000  # its last second, give or take the piece it dropped


def test_without_turn_detection_the_buffer_refuses_audio_past_its_limit():
    audio = InputAudio(None, max_seconds=1)
    audio.append(np.zeros(24_000 - 2400, np.float32))
    with pytest.raises(EventError, match="more than 1 s") as refused:
        audio.append(np.zeros(4800, np.float32))
    assert refused.value.code == "input_audio_buffer_full"


def test_a_spoken_replys_transcript_is_cut_at_the_text_sent_with_the_last_piece_of_audio_begun():
    spoken = SpokenText()
    for samples, chars in [(2400, 0), (2400, 5), (2400, 12)]:  # 100 ms pieces, and the transcript sent by then
        spoken.sent(samples, chars)
    assert [spoken.chars_at(ms) for ms in (0, 1, 100, 101, 200, 201, 300)] == [0, 0, 0, 5, 5, 12, 12]
    with pytest.raises(EventError, match="past the item's audio"):
        spoken.chars_at(301)


def test_a_truncated_reply_keeps_its_text_to_the_cut_and_drops_its_token_ids():
    reply = Item("item_r", "message", "assistant", text="Hello there, friend", token_ids=[1, 2, 3],
                 spoken=SpokenText([2400, 4800], [6, 19]))
    reply.truncate(50)
    assert reply.text == "Hello " and reply.token_ids is None
    with pytest.raises(EventError, match="not a spoken reply"):
        Item("item_u", "message", "user", text="hi").truncate(0)


def test_the_conversation_is_the_prompts_messages_with_a_responses_calls_on_its_reply():
    conversation = Conversation()
    speech = np.zeros(1600, np.float32)
    for item in [Item("u1", "message", "user", text="Weather?", audio=speech),
                 Item("a1", "message", "assistant", text="Looking.", response_id="r1", token_ids=[5]),
                 Item("c1", "function_call", "assistant", call=WEATHER, response_id="r1"),
                 Item("o1", "function_call_output", "tool", text="sunny", call_id="call_1")]:
        conversation.add(item)
    messages = conversation.messages("Be brief.")
    assert [(m.role, m.text) for m in messages] == [("system", "Be brief."), ("user", "Weather?"),
                                                     ("assistant", "Looking."), ("tool", "sunny")]
    assert messages[1].audios()[0] is speech and messages[2].tool_calls == (WEATHER,)
    assert messages[2].token_ids is None and messages[3].tool_call_id == "call_1"
    assert conversation.last_asks()


def test_a_call_of_a_response_without_text_is_a_reply_of_its_own_and_an_item_id_is_taken_once():
    conversation = Conversation()
    conversation.add(Item("u1", "message", "user", text="Weather?"))
    conversation.add(Item("c1", "function_call", "assistant", call=WEATHER, response_id="r1"))
    assert [(m.role, m.text, m.tool_calls) for m in conversation.messages("")][1] == ("assistant", "", (WEATHER,))
    assert not conversation.last_asks()
    with pytest.raises(EventError, match="already has an item u1"):
        conversation.add(Item("u1", "message", "user", text="again"))
