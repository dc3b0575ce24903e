"""The attention backends of decode steps on the demo model: `triton` (our kernel over the KV blocks,
in Triton's interpreter on CPU runs) gives the greedy replies, written and spoken, of `torch`
(transformers' attention over the rows gathered from the blocks). (What the setting picks:
test_triton_settings.py; the graphed prefills' kernel on a prefix: test_graph_writers.py.)"""

import torch

from omni_local.api import OmniLocal
from omni_local.kernels.attention.paged import paged_attention
from replies import send


def test_greedy_replies_spoken_and_not_with_the_triton_kernel_are_the_torch_backends(demo_settings, demo_checkpoint):
    replies = {}
    for backend in ("torch", "triton"):
        settings = demo_settings.replace(attention_backend=backend, speech=True, max_speech_seconds=1.0)
        with OmniLocal(settings) as app:
            engine = app.backend.engine
            expected = paged_attention if backend == "triton" else None
            for attention in (engine.runner.attention, engine.speaker.runner.attention):
                assert attention.decode is expected and attention.prefill is expected  # graphed, on a prefix
                assert attention.eager_prefill is None  # eager prefills: transformers' attention
            session = app.session()
            written = session.send("What do fishermen sing at night?", max_new_tokens=12).result()
            again = session.send("And in the morning?", max_new_tokens=6).result()  # decoding on a cached prefix
            spoken, frames, _, _ = send(app, app.session(), "Tell me about lighthouses.", voice="Chelsie")
            replies[backend] = written.token_ids, again.token_ids, spoken.token_ids, frames
    assert replies["triton"] == replies["torch"]
    assert all(replies["torch"])  # tokens written twice, tokens spoken, and codec frames


def test_a_started_engine_keeps_sdpa_off_cudnns_attention_which_plans_each_new_shape_anew(demo_settings,
                                                                                          demo_checkpoint):
    torch.backends.cuda.enable_cudnn_sdp(True)
    with OmniLocal(demo_settings):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
