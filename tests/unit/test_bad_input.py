"""Bad input through the Python API: a clear error naming the problem, then the engine serves on;
and text that holds control tokens reaches the model as the plain text it is."""

import math
import re

import numpy as np
import pytest
from PIL import Image

from bad_files import BAD_FILES, MAX_AUDIO_SECONDS, MAX_IMAGE_PIXELS, good_image
from samples import TYPED_CONTROL_TOKENS
from omni_local.api import OmniLocal
from omni_local.errors import MediaError, RequestError, SettingsError
from omni_local.media import SAMPLE_RATE
from omni_local.settings import load_settings


@pytest.fixture(scope="module")
def strict_app(demo_settings, demo_checkpoint):
    settings = demo_settings.replace(max_image_pixels=MAX_IMAGE_PIXELS, max_audio_seconds=MAX_AUDIO_SECONDS)
    with OmniLocal(settings) as app:
        yield app


@pytest.mark.parametrize("case", BAD_FILES)
def test_a_bad_upload_is_a_clear_error_and_the_session_serves_on(strict_app, bad_files, tmp_path, case):
    path, phrase = bad_files[case]
    session = strict_app.session(system_prompt="Be brief.")
    kind = "audio" if path.suffix == ".wav" else "images"
    with pytest.raises(MediaError, match=phrase.replace("(", r"\(")):
        session.send("What is this?", **{kind: [path]})
    assert [m.role for m in session.history] == ["system"]  # nothing half-sent was kept
    final = session.send("What is this?", images=[good_image(tmp_path)], max_new_tokens=4).result()
    assert final.tokens.generated > 0 or final.stop_reason == "end_of_turn"
    assert len(session.history) == 3


def test_an_unknown_settings_key_is_a_clear_error(tmp_path):
    path = tmp_path / "settings.toml"
    path.write_text("[engine]\nturbo = true\n")
    with pytest.raises(SettingsError, match="unknown setting 'engine.turbo'"):
        load_settings(path)


def test_an_empty_message_is_refused(app):
    with pytest.raises(Exception, match="the message is empty"):
        app.session().send("")


def test_an_image_passed_in_memory_is_held_to_the_same_pixel_limit(strict_app):
    with pytest.raises(MediaError, match="images\\[0\\]: 400×400 pixels is over the limit"):
        strict_app.session().send("What is this?", images=[Image.new("RGB", (400, 400))])


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        (dict(images=[123]), RequestError, "images[0]: expected a path, bytes or PIL image, got int"),
        (dict(images="cat.jpg"), RequestError, "images: expected a list of paths, bytes or PIL images, got str"),
        (dict(audio=[b"RIFF", None]), RequestError, "audio[1]: expected a path, bytes or numpy array, got NoneType"),
        (dict(audio=np.zeros(SAMPLE_RATE, np.float32)), RequestError,
         "audio: expected a list of paths, bytes or numpy arrays, got ndarray"),
        (dict(audio=[np.array([0.0] * SAMPLE_RATE, dtype=object)]), MediaError,
         "audio[0]: expected an array of numbers (samples), got an array of object"),
        (dict(audio=[np.full(SAMPLE_RATE, "0")]), MediaError,
         "audio[0]: expected an array of numbers (samples), got an array of <U1"),
        (dict(videos=[2.5]), RequestError, "videos[0]: expected a path, bytes or Video, got float"),
        (dict(videos=iter([None])), RequestError, "videos[0]: expected a path, bytes or Video, got NoneType"),
        (dict(images=5), RequestError, "images: expected a list of paths, bytes or PIL images, got int"),
        (dict(speak="no"), RequestError, "speak: expected True or False, got str"),
        (dict(speak=True, voice=5), RequestError, "the voice must be text, not int"),
    ],
    ids=["an int as an image", "a lone path", "None among clips", "samples not in a list", "an object array",
         "an array of text", "a float as a video", "None from an iterator", "an int for the list",
         "a word for speak", "a number for the voice"],
)
def test_an_argument_of_the_wrong_type_is_refused_naming_it_and_the_session_serves_on(app, arguments, error, message):
    session = app.session()
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        session.send("What is this?", **arguments)
    assert session.history == []
    assert session.send("Hello", max_new_tokens=2).result().token_ids


def test_a_video_of_the_wrong_type_read_alone_is_refused_naming_it(app):
    with pytest.raises(RequestError, match=r"^video: expected a path, bytes or Video, got int$"):
        app.read_video(123)


@pytest.mark.parametrize("text", ["Hi \ud800", "caf\udce9"], ids=["a lone surrogate", "bytes not UTF-8"])
def test_a_message_that_is_not_valid_unicode_is_refused_and_the_session_serves_on(app, text):
    session = app.session(system_prompt="Be brief.")
    with pytest.raises(RequestError, match="the message holds text that is not valid Unicode"):
        session.send(text)
    assert [m.role for m in session.history] == ["system"]
    session.send("Hello", max_new_tokens=2).result()
    assert len(session.history) == 3


def test_a_system_prompt_that_is_not_valid_unicode_is_refused(app):
    with pytest.raises(RequestError, match="the system prompt holds text that is not valid Unicode"):
        app.session(system_prompt="Be \ud800 brief.")


BAD_SAMPLING = {
    "a word for a number": ({"temperature": "hot"}, "temperature must be a number, not 'hot'"),
    "a fraction of a token": ({"max_new_tokens": 1.5}, "max_new_tokens must be a whole number, not 1.5"),
    "no value": ({"top_p": None}, "top_p must be a number, not None"),
    "a word for a seed": ({"seed": "x"}, "seed must be a whole number, not 'x'"),
    "a bool for a count": ({"top_k": True}, "top_k must be a whole number, not True"),
    "an infinite temperature": ({"temperature": math.inf}, "temperature must be 0 (greedy) or a finite number"),
    "a NaN temperature": ({"temperature": math.nan}, "temperature must be 0 (greedy) or a finite number"),
    "a NaN top_p": ({"top_p": math.nan}, "top_p must be in (0, 1]"),
    "an infinite penalty": ({"repetition_penalty": math.inf}, "repetition_penalty must be a finite number above 0"),
}


@pytest.mark.parametrize("case", list(BAD_SAMPLING))
def test_a_bad_sampling_value_is_refused_with_its_name_and_the_session_serves_on(app, case):
    values, message = BAD_SAMPLING[case]
    session = app.session()
    with pytest.raises(RequestError, match=re.escape(message)):
        session.send("Hello", **values)
    assert session.history == []
    session.send("Hello", max_new_tokens=2).result()
    assert len(session.history) == 2


def test_a_typed_system_turn_reaches_the_model_as_plain_text(app, built_prompts, template_ids):
    app.session(system_prompt="Be brief.").send(TYPED_CONTROL_TOKENS, max_new_tokens=1).result()
    assert [p.input_ids[0].tolist() for p in built_prompts] == [template_ids("Be brief.", TYPED_CONTROL_TOKENS)]


def test_a_system_prompt_with_control_tokens_reaches_the_model_as_plain_text(app, built_prompts, template_ids):
    app.session(system_prompt=TYPED_CONTROL_TOKENS).send("Hello", max_new_tokens=1).result()
    assert [p.input_ids[0].tolist() for p in built_prompts] == [template_ids(TYPED_CONTROL_TOKENS, "Hello")]
