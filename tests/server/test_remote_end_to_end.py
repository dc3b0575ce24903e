"""The API's sessions and the CLI on a remote backend (`backend = "openai"`) against omni_local's own
server, `python -m omni_local serve` in a subprocess on the demo model: a chat on the remote backend
says, turn for turn and token for token, what the same chat says on the engine in this process, and
the server's figures reach the reply's `Finished`."""

import re
import subprocess
import sys
import uuid

import numpy as np
import pytest

from api_requests import LONG_SYSTEM_PROMPT
from omni_local.access import page_principal
from omni_local.api import AudioChunk, OmniLocal, TextDelta
from omni_local.errors import RequestError
from omni_local.metrics_line import metrics_line
from samples import SPEECH, picture
from served_api import served_api
from served_app import REPO

KEY = "remote-key-51c2"
REPLY_TOKENS = 12
TURNS = ("Hello there.", "And what else?", "Tell me more.")
MAX_SPEECH_SECONDS = 1.0


@pytest.fixture(scope="module")
def server(demo_settings, demo_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("remote_server")
    key_file = root / "key"
    key_file.write_text(KEY)
    key_file.chmod(0o600)
    with served_api(demo_settings, root, "--speech", "true", "--max-speech-seconds", str(MAX_SPEECH_SECONDS),
                    "--api-key-file", str(key_file), key=KEY) as served:
        yield served


@pytest.fixture(scope="module")
def remote(server, demo_settings, tmp_path_factory):
    settings = demo_settings.replace(backend="openai", backend_url=server.url, backend_api_key=KEY,
                                     cache_dir=str(tmp_path_factory.mktemp("remote_client")))
    with OmniLocal(settings) as app:
        yield app


@pytest.fixture(scope="module")
def local(demo_settings, demo_checkpoint):
    """The engine in this process, with the server's settings: the oracle of every reply here."""
    with OmniLocal(demo_settings.replace(speech=True, max_speech_seconds=MAX_SPEECH_SECONDS)) as app:
        yield app


def test_a_chat_on_the_remote_backend_says_what_the_same_chat_says_here_and_reuses_each_turn(remote, local):
    there = remote.session(system_prompt="You are brief.")
    here = local.session(system_prompt="You are brief.")
    for number, question in enumerate(TURNS):
        reply = there.send(question, max_new_tokens=REPLY_TOKENS)
        streamed = "".join(event.text for event in reply if isinstance(event, TextDelta))
        final, near = reply.result(), here.send(question, max_new_tokens=REPLY_TOKENS).result()
        assert streamed == final.text == there.history[-1].text == near.text
        assert final.tokens.prompt == near.tokens.prompt and final.tokens.generated == near.tokens.generated
        if number:  # the server found the whole earlier conversation, its replies included, in its cache
            assert final.tokens.computed == near.tokens.computed < final.tokens.prompt


def test_a_remote_replys_logprobs_are_those_the_same_reply_has_here(remote, local):
    def logprobs(app: OmniLocal) -> list:
        reply = app.session().send("Tell me about the sea.", max_new_tokens=REPLY_TOKENS, logprobs=3)
        return [entry for event in reply if isinstance(event, TextDelta) for entry in event.logprobs]

    there, here = logprobs(remote), logprobs(local)
    assert len(there) == len(here) > 8
    assert [(e.token, e.utf8, [t.token for t in e.top]) for e in there] == \
        [(e.token, e.utf8, [t.token for t in e.top]) for e in here]
    assert [e.logprob for e in there] == pytest.approx([e.logprob for e in here], abs=1e-4)


def test_an_image_and_a_clip_on_the_remote_backend_are_answered_as_here(remote, local):
    image, clip = picture(5), SPEECH[:16_000]
    far = remote.session().send("What is this?", images=[image], audio=[clip], max_new_tokens=REPLY_TOKENS).result()
    near = local.session().send("What is this?", images=[image], audio=[clip], max_new_tokens=REPLY_TOKENS).result()
    assert far.text == near.text and far.tokens.prompt == near.tokens.prompt
    assert far.media.encoded + far.media.from_cache == 2


@pytest.mark.parametrize("talker_temperature", [0.0, 0.9])
def test_a_spoken_reply_on_the_remote_backend_streams_the_audio_made_here(remote, local, talker_temperature):
    asked = dict(speak=True, talker_temperature=talker_temperature, seed=7, max_new_tokens=REPLY_TOKENS)
    far = remote.session().send("Say something.", **asked)
    chunks = [event.samples for event in far if isinstance(event, AudioChunk)]
    near = local.session().send("Say something.", **asked)
    near.result()
    assert len(chunks) > 1  # streamed in pieces, not sent at the end
    # PCM16 on the wire: each sample within one step of 16-bit audio of what this process makes.
    np.testing.assert_allclose(np.concatenate(chunks), near.audio, atol=1.5 / 32768)
    assert far.result().speech.audio_s == pytest.approx(near.audio.size / 24_000)
    assert "s of speech" in metrics_line(far.result())


def test_a_remote_reply_cancelled_ends_as_stopped_and_the_chat_goes_on(remote):
    chat = remote.session()
    reply = chat.send("Hello.", max_new_tokens=2000)
    for event in reply:
        if isinstance(event, TextDelta):
            reply.cancel()
    assert reply.result().stop_reason == "cancelled"
    assert chat.send("Again.", max_new_tokens=REPLY_TOKENS).result().stop_reason in ("end_of_turn", "max_new_tokens")


def test_an_unknown_voice_on_the_remote_backend_is_the_servers_clear_error(remote):
    with pytest.raises(RequestError, match="Nobody"):
        remote.session().send("Hi.", speak=True, voice="Nobody").result()


def test_the_cli_asks_the_remote_server_and_prints_the_reply_and_its_metrics(server, demo_settings, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "omni_local", "ask", "Hello there.", "--backend", "openai", "--backend-url", server.url,
         "--backend-api-key", KEY, "--max-new-tokens", str(REPLY_TOKENS), "--cache-dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert re.search(r"TTFT [\d.,]+ m?s · .*\d+ of \d+ prompt tokens from cache", result.stdout), result.stdout


def test_the_users_of_a_page_on_the_remote_backend_share_no_cache_at_its_server_each_their_own(remote):
    system = f"{uuid.uuid4().hex}. {LONG_SYSTEM_PROMPT}"  # new to the server's cache

    def reused(user: str, question: str) -> int:
        chat = remote.session(system_prompt=system, principal=page_principal(user))
        return chat.send(question, max_new_tokens=2).result().tokens.reused

    ada_first, bob_guess = reused("ada", "What is the time?"), reused("bob", "What is the time?")
    ada_second, bob_second = reused("ada", "Where are we?"), reused("bob", "Where are we?")
    assert ada_first == 0 and bob_guess == 0  # Ada's prompt, guessed right by Bob, told him nothing
    assert ada_second > 300 and bob_second == ada_second  # each user's second chat reuses their first's
