"""A prompt's 3D rotary positions, worked out from its list of media, are the bits transformers'
`get_rope_index` gives, with the Thinker's settings and the Talker's, on every kind of prompt."""

import pytest
import torch

from samples import clip, picture, video_file
from omni_local.engine.forward.decoder_stack import mrope_positions
from omni_local.engine.forward.rope_positions import _interleaved
from omni_local.engine.prompt.builder import Prompt, build_prompt
from omni_local.protocol.messages import Message

with_video = pytest.mark.torchvision

CASES = {
    "text": lambda app: [Message("user", ["Hello there."])],
    "an image": lambda app: [Message("user", [picture(1), "What is this?"])],
    "two images of different sizes": lambda app: [
        Message("user", ["Compare", picture(2, (224, 160)), "with", picture(3, (96, 320)), "please."])],
    "a clip": lambda app: [Message("user", [clip(4, 2.5), "What do you hear?"])],
    "a 1 s video": pytest.param(lambda app: [Message("user", [app.read_video(video_file(5, 1.0)), "And?"])],
                                marks=with_video),
    "a 3.5 s video": pytest.param(lambda app: [Message("user", [app.read_video(video_file(6, 3.5)), "And?"])],
                                  marks=with_video),
    "a chat with every kind, over two turns": pytest.param(lambda app: [
        Message("system", ["You are brief."]),
        Message("user", [picture(7), clip(8, 1.0), "Say what these are."]),
        Message("assistant", ["A picture and a sound."]),
        Message("user", [app.read_video(video_file(9, 2.0)), picture(10, (128, 64)), "And these?"]),
    ], marks=with_video),
}


def transformers_positions(owner: torch.nn.Module, prompt: Prompt) -> tuple[torch.Tensor, int]:
    ids = prompt.input_ids
    positions, deltas = owner.get_rope_index(
        ids, image_grid_thw=prompt.image_grid_thw, video_grid_thw=prompt.video_grid_thw,
        attention_mask=torch.ones_like(ids), use_audio_in_video=prompt.use_audio_in_video,
        audio_seqlens=prompt.audio_feature_lengths, second_per_grids=prompt.video_second_per_grid)
    return positions, int(deltas.reshape(-1)[0])


@pytest.mark.parametrize("owner", ["thinker", "talker"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_the_positions_are_the_bits_of_transformers_get_rope_index(speaking_app, case, owner):
    app = speaking_app
    loaded = app.backend.loaded
    model = getattr(loaded.model, owner)
    prompt = build_prompt(case(app), loaded.processor)
    positions, delta = mrope_positions(model, prompt, torch.device("cpu"))
    expected, expected_delta = transformers_positions(model, prompt)
    assert positions.dtype == expected.dtype and torch.equal(positions, expected)
    assert delta == expected_delta


def test_a_video_whose_sound_outlasts_its_frames_ends_on_its_sound_and_the_other_way_round():
    # The piece the next position counts on from: the run of one kind the merge ends with.
    frames = torch.tensor([[0.0, 0.0, 4.0, 4.0], [5.0, 6.0, 5.0, 6.0], [5.0, 5.0, 6.0, 6.0]])
    merged, tail = _interleaved(frames, torch.arange(7).expand(3, -1) + 0.0)
    assert merged[0].tolist() == [0, 0, 0, 1, 2, 3, 4, 4, 4, 5, 6]  # a frame first on a tie
    assert tail.tolist() == [[4, 5, 6]] * 3  # the sound from the last frame's time on
    merged, tail = _interleaved(frames, torch.arange(3).expand(3, -1) + 0.0)
    assert tail.tolist() == frames[:, 2:].tolist()


@with_video
def test_the_talkers_own_prompt_of_a_chat_with_every_kind_gets_the_positions_of_transformers(speaking_app):
    # The Talker's prompt keeps the user turns' tokens, its media renumbered, then its own rows.
    from omni_local.engine.forward.talker import user_positions

    speaker = speaking_app.backend.engine.speaker
    runner = speaker.runner
    thinker = build_prompt(CASES["a chat with every kind, over two turns"].values[0](speaking_app),
                           speaking_app.backend.loaded.processor)
    users = user_positions(thinker.input_ids[0], speaker.im_start, speaker.user)
    talker = runner.build_prompt(thinker, torch.zeros(len(users), 1), users, first_token=11,
                                 voice=runner.voice_id("Chelsie")).prompt
    assert len(talker.media) == 4 and talker.num_tokens > len(users)

    positions, delta = mrope_positions(runner.talker, talker, torch.device("cpu"))

    expected, expected_delta = transformers_positions(runner.talker, talker)
    assert torch.equal(positions, expected) and delta == expected_delta
