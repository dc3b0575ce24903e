"""On a GPU Code2Wav's chunks replay CUDA graphs, one per chunk length, and give the samples eager
chunks give, a last chunk padded to a longer graph included.

Run with OMNI_LOCAL_TEST_DEVICE=cuda on a machine with a CUDA GPU; elsewhere every test is skipped.
"""

import numpy as np
import pytest
import torch

from replies import send
from omni_local.engine.forward.vocoder import AudioStream, Vocoder
from omni_local.model import load_model

pytestmark = pytest.mark.cuda

# Waveforms on a GPU: cuDNN convolutions run in TF32 and choose their algorithm by length, as in
# test_speech.py; a padded chunk runs at its graph's length.
ATOL = 5e-5


@pytest.fixture(scope="module")
def code2wav(on_gpu, demo_settings) -> torch.nn.Module:
    """Code2Wav of a model loaded with speech, on the GPU (`on_gpu` skips the test elsewhere)."""
    return load_model(demo_settings.replace(speech=True)).model.code2wav


def vocoders(code2wav: torch.nn.Module) -> tuple[Vocoder, Vocoder]:
    """Default chunking (2 frames first, up to 10, 25 of left context), graphed and eager, warmed up."""
    graphed, eager = (Vocoder(code2wav, 2, 10, 25, cuda_graphs=graphs) for graphs in (True, False))
    for vocoder in (graphed, eager):
        vocoder.warm_up([0] * code2wav.config.num_quantizers)
    return graphed, eager


def stream_chunks(vocoder: Vocoder, frames: list[list[int]]) -> list[np.ndarray]:
    """The chunks a reply of `frames` is sent in, as Speaker.frame_out decodes them."""
    stream, chunks = AudioStream(), []
    for i, frame in enumerate(frames):
        stream.frames.append(frame)
        if vocoder.due(stream, final=i == len(frames) - 1):
            chunks.append(vocoder.decode(stream))
    return chunks


@pytest.mark.parametrize("count", [1, 3, 41, 64])
def test_graphed_chunks_give_the_samples_of_eager_chunks(code2wav, count):
    # 1 frame: one chunk of 1, padded to 2; 3: a last chunk of 3 padded to 6; 41: of 32 padded to 34;
    # 64: every chunk full.
    graphed, eager = vocoders(code2wav)
    assert graphed.graphs is not None and graphed.graphs.lengths == [2, 6, 14, 24, 34, 35]
    assert eager.graphs is None
    groups, codebook = code2wav.config.num_quantizers, code2wav.config.codebook_size
    frames = torch.randint(0, codebook, (count, groups), generator=torch.Generator().manual_seed(count)).tolist()

    graphed_chunks, eager_chunks = stream_chunks(graphed, frames), stream_chunks(eager, frames)

    assert [c.shape for c in graphed_chunks] == [c.shape for c in eager_chunks]
    for got, want in zip(graphed_chunks, eager_chunks):
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


def test_a_chunk_longer_than_every_graph_is_a_clear_error(code2wav):
    graphed, _ = vocoders(code2wav)
    codes = torch.zeros(1, code2wav.config.num_quantizers, 36, dtype=torch.long, device="cuda")
    with pytest.raises(ValueError, match="chunks of up to 35 frames, not 36"), torch.inference_mode():
        graphed.graphs.replay(codes)


def test_a_spoken_reply_with_graphs_on_has_the_frames_and_audio_of_eager(speaking_graphed_and_eager):
    graphed, eager = speaking_graphed_and_eager
    assert graphed.backend.engine.speaker.vocoder.graphs is not None
    assert eager.backend.engine.speaker.vocoder.graphs is None
    (final, frames, audio, _), (_, eager_frames, eager_audio, _) = (
        send(app, app.session(), "Tell me a story about a lighthouse keeper.", voice="Chelsie")
        for app in (graphed, eager)
    )
    assert frames == eager_frames and final.speech.frames == len(frames)
    assert audio.shape == eager_audio.shape
    np.testing.assert_allclose(audio, eager_audio, atol=ATOL, rtol=0)
