"""On a GPU the Thinker's decode step replays CUDA graphs, and gives the tokens eager decoding gives.

Run with OMNI_LOCAL_TEST_DEVICE=cuda on a machine with a CUDA GPU; elsewhere every test is skipped.
"""

import pytest
import torch

from test_thinker_parity import model_inputs, reference_tokens
from omni_local.api import OmniLocal
from omni_local.engine.decode_graphs import SMALLEST_BUCKET
from omni_local.engine.thinker import ThinkerRunner
from omni_local.prompts import Message, Prompt, build_prompt

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU, and none is visible"
)

STORY = "The lighthouse keeper counted the ships that passed his rock every night of the year. "
SONG = "A fisherman sang about the moon and the tide while he mended his nets in the harbour. "


@pytest.fixture(scope="module")
def on_gpu(app: OmniLocal) -> OmniLocal:
    if app.engine.runner.device.type != "cuda":
        pytest.skip("the demo model runs on the CPU: set OMNI_LOCAL_TEST_DEVICE=cuda")
    return app


def runner(app: OmniLocal, cuda_graphs: bool) -> ThinkerRunner:
    """A runner of the app's Thinker with two slots of its own, warmed up (graphs captured)."""
    kv = app.engine.runner.kv
    built = ThinkerRunner(app.loaded.model.thinker, app.engine.runner.encoder, 2 * kv.shape.slot_bytes(kv.dtype),
                          kv.shape.max_tokens, cuda_graphs=cuda_graphs)
    built.warm_up()
    return built


def prompt_under_bucket(app: OmniLocal, sentence: str) -> Prompt:
    """A text prompt as long as `sentence` repeated fits under the smallest graph's rows."""
    def prompt(repeats: int) -> Prompt:
        return build_prompt([Message("user", [sentence * repeats])], app.loaded.processor)

    repeats = 1
    while prompt(repeats + 1).num_tokens < SMALLEST_BUCKET - 24:
        repeats += 1
    return prompt(repeats)


def greedy_in_turns(
    thinker: ThinkerRunner, prompts: list[Prompt], steps: int, banned: torch.Tensor
) -> list[list[int]]:
    """Greedy replies to `prompts`, each in its own slot, their decode steps taken in turns."""
    slots = [thinker.kv.allocate() for _ in prompts]
    prepared = [thinker.prepare(prompt, 0, remember=False) for prompt in prompts]
    replies = [[pick(thinker.prefill(slot, p), banned)] for slot, p in zip(slots, prepared)]
    for step in range(steps - 1):
        for slot, p, prompt, reply in zip(slots, prepared, prompts, replies):
            reply.append(pick(thinker.decode(slot, reply[-1], prompt.num_tokens + step, p.rope_delta), banned))
    for slot in slots:
        thinker.kv.release(slot)
    return replies


def pick(logits: torch.Tensor, banned: torch.Tensor) -> int:
    return int(logits.index_fill(0, banned, float("-inf")).argmax())


def generate(app: OmniLocal, prompt: Prompt, steps: int, banned: list[int]) -> list[int]:
    with torch.inference_mode():
        output = app.loaded.model.thinker.generate(
            **model_inputs(app, prompt), max_new_tokens=steps, do_sample=False, suppress_tokens=banned
        )
    return output[0, prompt.num_tokens :].tolist()


def test_graphed_decode_in_two_slots_across_a_bucket_boundary_matches_eager_and_generate(on_gpu):
    app = on_gpu
    prompts = [prompt_under_bucket(app, STORY), prompt_under_bucket(app, SONG)]
    # Past the first bucket's rows for both replies; the end of turn is banned so none stops early.
    steps = SMALLEST_BUCKET - min(p.num_tokens for p in prompts) + 16
    assert all(p.num_tokens < SMALLEST_BUCKET < p.num_tokens + steps - 2 for p in prompts)
    banned = [*app.engine.suppressed_ids, *app.engine.eos_ids]
    banned_ids = torch.tensor(banned, device=app.engine.runner.device)
    graphed_runner, eager_runner = runner(app, cuda_graphs=True), runner(app, cuda_graphs=False)
    assert graphed_runner.graphs is not None and eager_runner.graphs is None

    graphed = greedy_in_turns(graphed_runner, prompts, steps, banned_ids)
    eager = greedy_in_turns(eager_runner, prompts, steps, banned_ids)

    assert graphed == eager
    assert graphed == [generate(app, prompt, steps, banned) for prompt in prompts]


def test_a_chats_second_turn_on_the_prefix_cache_matches_generate_with_graphs_on(on_gpu):
    app = on_gpu
    assert app.engine.runner.graphs is not None
    session = app.session(system_prompt="You answer in one sentence.")
    for text in ["Tell me about lighthouses.", "And about the ships they guide?"]:
        before = list(session.history)
        final = session.send(text, max_new_tokens=24).result()
        assert final.token_ids == reference_tokens(app, [*before, Message("user", [text])])
    assert final.tokens.reused_gpu > 0, "the second turn must continue the first turn's KV"
