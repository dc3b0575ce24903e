"""Who shares what through the API: each key of the key file is a person of their own (a principal),
whose prompts and images no other key's requests reuse, find or hear of (`cached_tokens`, the media
figures), while one person's chats share among themselves. `python -m omni_local serve` in a
subprocess, driven by the official `openai` package."""

import uuid

import openai
import pytest

from api_requests import LONG_SYSTEM_PROMPT, SHORT, ask, image_part, png, private_file
from omni_local.access import read_api_keys
from omni_local.errors import SettingsError
from served_api import client, served_api

ADA, BOB = "key-of-ada-5c1e", "key-of-bob-90d2"


@pytest.fixture(scope="module")
def two_keys(demo_settings, demo_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("served_api_two_keys")
    key_file = private_file(root / "keys", f"# one key a person\nada: {ADA}\n\nbob: {BOB}\n")
    with served_api(demo_settings, root, "--api-key-file", str(key_file), key=ADA) as served:
        yield served


def cached(reply) -> int:
    return reply.usage.prompt_tokens_details.cached_tokens


def test_each_key_of_the_key_file_is_let_in_and_any_other_is_401(two_keys):
    assert ask(client(two_keys.url, ADA), "Hi", max_tokens=2).usage.completion_tokens == 2
    assert ask(client(two_keys.url, BOB), "Hi", max_tokens=2).usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        ask(client(two_keys.url, "ada"), "Hi", max_tokens=2)  # a name is not a key


def test_one_persons_prompt_is_never_reused_for_another_whose_own_second_chat_reuses_theirs(two_keys):
    system = f"{uuid.uuid4().hex}. {LONG_SYSTEM_PROMPT}"  # new to the cache
    ada, bob = client(two_keys.url, ADA), client(two_keys.url, BOB)
    ada_first = ask(ada, "What is the time?", system=system)
    bob_guess = ask(bob, "What is the time?", system=system)  # Ada's very prompt, guessed right
    ada_second = ask(ada, "Where are we?", system=system)
    bob_second = ask(bob, "Where are we?", system=system)
    assert ada_first.usage.prompt_tokens > 300 and cached(ada_first) == 0
    assert cached(bob_guess) == 0  # nothing of Ada's: not told of it, nor spared computing it
    assert cached(ada_second) > 300  # the system prompt, from Ada's first chat
    assert cached(bob_second) == cached(ada_second)  # ... and Bob's from his own


def test_a_prompt_cache_key_divides_one_keys_caches_and_names_no_part_of_another_keys(two_keys):
    system = f"{uuid.uuid4().hex}. {LONG_SYSTEM_PROMPT}"
    ada, bob = client(two_keys.url, ADA), client(two_keys.url, BOB)
    team = {"extra_body": {"prompt_cache_key": "team"}}
    assert cached(ask(ada, "What is the time?", system=system, **team)) == 0
    assert cached(ask(ada, "What is the time?", system=system)) == 0  # Ada's requests without the key
    assert cached(ask(bob, "What is the time?", system=system, **team)) == 0  # Bob's "team" is his own
    assert cached(ask(ada, "Where are we?", system=system, **team)) > 300


def test_one_persons_image_is_not_found_in_the_encoder_cache_by_another(two_keys):
    ada, bob = client(two_keys.url, ADA), client(two_keys.url, BOB)
    content = [image_part(png(int(uuid.uuid4().int % 10_000))), {"type": "text", "text": "What is it?"}]

    def media(api: openai.OpenAI) -> dict:
        system = uuid.uuid4().hex  # a chat of its own: the image is not in its cached prompt
        return ask(api, content, max_tokens=SHORT, system=system).model_extra["omni_local"]["media"]

    assert media(ada) == {"in_kv": 0, "from_cache": 0, "encoded": 1}
    assert media(bob) == {"in_kv": 0, "from_cache": 0, "encoded": 1}  # not told that Ada sent it
    assert media(bob) == {"in_kv": 0, "from_cache": 1, "encoded": 0}  # his own, the second time


def test_a_key_file_names_each_keys_holder_by_its_name_or_its_order():
    keys = read_api_keys("# the team\nada: k-1:with-colons\n\nk-2\n  bob:   k-3  \n", "api_key_file 'keys'")
    assert keys.holders == {"k-1:with-colons": "ada", "k-2": "2", "k-3": "bob"}
    assert keys.holder("k-3") == "bob" and keys.holder("k-2") == "2" and keys.holder("k-") is None
    assert read_api_keys("just-one-key\n", "api_key_file 'key'").holders == {"just-one-key": "1"}


@pytest.mark.parametrize("text, why", [
    ("ada: k-1\nbob k-2\n", "line 2 must be one key (a word without spaces) or 'NAME: KEY'"),
    ("ada: k-1\nada: k-2\n", "line 2 repeats the name 'ada'"),
    ("ada: k-1\nbob: k-1\n", "line 2 repeats a key: give each person a key of their own"),
    ("# no key\n\n", "must hold a key: one a line, 'KEY' or 'NAME: KEY'"),
])
def test_a_key_file_that_is_not_one_key_a_line_is_refused_by_line_never_showing_a_key(text, why):
    with pytest.raises(SettingsError) as refused:
        read_api_keys(text, "api_key_file 'keys'")
    assert why in str(refused.value) and "k-2" not in str(refused.value)
