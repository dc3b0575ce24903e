"""On a GPU the Thinker's decode steps (several chats in one batch), its prefills and prefill chunks,
and the Talker's steps, replay CUDA graphs, and give the tokens and codec codes eager decoding gives.

Run with OMNI_LOCAL_TEST_DEVICE=cuda on a machine with a CUDA GPU; elsewhere every test is skipped.
"""

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from replies import model_inputs, reference_tokens, send, transformers_speech
from samples import picture
from waiting import until
from omni_local.api import OmniLocal
from omni_local.kernels.attention.paged import SPLIT_TAIL_TOKENS
from omni_local.engine.forward.cuda_graphs import SMALLEST_BUCKET, BatchGraphs, capture_graph, prefill_lengths
from omni_local.engine.memory.kv_store import NO_PREFIX
from omni_local.engine.prompt.builder import Prompt, build_prompt
from omni_local.engine.forward.thinker import ThinkerRunner
from omni_local.protocol.messages import Message

pytestmark = pytest.mark.cuda

STORY = "The lighthouse keeper counted the ships that passed his rock every night of the year. "
SONG = "A fisherman sang about the moon and the tide while he mended his nets in the harbour. "


def runner(app: OmniLocal, cuda_graphs: bool, chats: int = 2) -> ThinkerRunner:
    """A runner of the app's Thinker with blocks for `chats` chats of its own and decode steps of
    that many, warmed up (graphs captured)."""
    kv, settings = app.backend.engine.runner.kv, app.settings
    budget = (chats * kv.shape.table_blocks + 1) * kv.shape.block_bytes(kv.dtype)
    lengths = prefill_lengths(settings.prefill_chunk_tokens, settings.prefill_forward_tokens)
    built = ThinkerRunner(app.backend.loaded.model.thinker, app.backend.engine.runner.encoder, budget,
                          kv.shape.max_tokens, lengths, chats, cuda_graphs=cuda_graphs)
    built.warm_up()
    return built


def one_turn(app: OmniLocal, text: str) -> Prompt:
    return build_prompt([Message("user", [text])], app.backend.loaded.processor)


def text_under_bucket(app: OmniLocal, sentence: str) -> str:
    """`sentence` repeated as often as a prompt of it fits under the smallest graph's rows."""
    text = sentence
    while one_turn(app, text + sentence).num_tokens < SMALLEST_BUCKET - 24:
        text += sentence
    return text


def greedy_in_turns(
    thinker: ThinkerRunner, prompts: list[Prompt], steps: int, banned: torch.Tensor
) -> list[list[int]]:
    """Greedy replies to `prompts`, each in its own blocks, their decode steps taken in turns."""
    tables = [thinker.kv.take(thinker.kv.shape.table_blocks) for _ in prompts]
    prepared = [thinker.prepare(prompt, 0, remember=False) for prompt in prompts]
    replies = [[pick(thinker.prefill(table, p), banned)] for table, p in zip(tables, prepared)]
    for step in range(steps - 1):
        for table, p, prompt, reply in zip(tables, prepared, prompts, replies):
            logits = thinker.decode([table], [reply[-1]], [prompt.num_tokens + step], [p.rope_delta])[0]
            reply.append(pick(logits, banned))
    for table in tables:
        thinker.kv.pool.release(table)
    return replies


def greedy_together(thinker: ThinkerRunner, prompts: list[Prompt], steps: int, banned: torch.Tensor) -> list[list[int]]:
    """Greedy replies to `prompts`, each in its own blocks, each decode step one forward of them all."""
    tables = [thinker.kv.take(thinker.kv.shape.table_blocks) for _ in prompts]
    prepared = [thinker.prepare(prompt, 0, remember=False) for prompt in prompts]
    replies = [[pick(thinker.prefill(table, p), banned)] for table, p in zip(tables, prepared)]
    for step in range(steps - 1):
        logits = thinker.decode(tables, [reply[-1] for reply in replies], [p.num_tokens + step for p in prompts],
                                [p.rope_delta for p in prepared])
        for reply, row in zip(replies, logits):
            reply.append(pick(row, banned))
    for table in tables:
        thinker.kv.pool.release(table)
    return replies


def pick(logits: torch.Tensor, banned: torch.Tensor) -> int:
    return int(logits.index_fill(0, banned, float("-inf")).argmax())


def generate(app: OmniLocal, prompt: Prompt, steps: int, banned: list[int]) -> list[int]:
    with torch.inference_mode():
        output = app.backend.loaded.model.thinker.generate(
            **model_inputs(app, prompt), max_new_tokens=steps, do_sample=False, suppress_tokens=banned
        )
    return output[0, prompt.num_tokens :].tolist()


def test_graphs_captured_one_after_another_keep_their_outputs_and_no_workspace_of_their_own(on_gpu):
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(512, 512, device="cuda", dtype=torch.bfloat16)
    kept = [capture_graph(lambda: x @ weight, torch.cuda.graph_pool_handle())]  # this thread's stream set up
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()

    kept += [capture_graph(lambda: x @ weight, torch.cuda.graph_pool_handle()) for _ in range(8)]

    torch.cuda.synchronize()
    outputs = 8 * x.shape[0] * weight.shape[1] * x.element_size()
    # cuBLAS keeps a workspace (MiBs) for each stream a matmul ran on: a stream per capture kept one each.
    assert torch.cuda.memory_allocated() - before < outputs + (1 << 20)


def test_a_capture_that_runs_out_of_memory_gives_the_cache_back_and_tries_once_more(monkeypatch):
    x = torch.randn(64, 64, device="cuda")
    runs, emptied = [], []

    def run() -> torch.Tensor:
        runs.append(len(emptied))
        if len(runs) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory, as under a cap with the cache full")
        return x @ x

    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    graph, output = capture_graph(run, torch.cuda.graph_pool_handle())
    graph.replay()
    assert runs[1:] and runs[1] == 1, "the cache is given back before the second try"
    torch.testing.assert_close(output, x @ x)


def test_graphed_decode_of_two_chats_across_a_bucket_boundary_matches_eager_and_generate(on_gpu):
    app = on_gpu
    prompts = [one_turn(app, text_under_bucket(app, sentence)) for sentence in (STORY, SONG)]
    # Past the first bucket's rows for both replies; the end of turn is banned so none stops early.
    steps = SMALLEST_BUCKET - min(p.num_tokens for p in prompts) + 16
    assert all(p.num_tokens < SMALLEST_BUCKET < p.num_tokens + steps - 2 for p in prompts)
    banned = [*app.backend.engine.suppressed_ids, *app.backend.engine.eos_ids]
    banned_ids = torch.tensor(banned, device=app.backend.engine.runner.device)
    graphed_runner, eager_runner = runner(app, cuda_graphs=True), runner(app, cuda_graphs=False)
    assert graphed_runner.decode_graphs is not None and eager_runner.decode_graphs is None

    graphed = greedy_in_turns(graphed_runner, prompts, steps, banned_ids)
    eager = greedy_in_turns(eager_runner, prompts, steps, banned_ids)

    assert graphed == eager
    assert graphed == [generate(app, prompt, steps, banned) for prompt in prompts]


def test_three_chats_decoding_as_one_graphed_batch_give_the_tokens_each_gives_alone(on_gpu):
    app = on_gpu
    # Three prompts of different lengths: a batch of three runs in the graphs of four, padded.
    prompts = [one_turn(app, text) for text in (STORY, SONG + SONG, text_under_bucket(app, STORY))]
    steps = SMALLEST_BUCKET - max(p.num_tokens for p in prompts) + 12  # the longest crosses a bucket
    banned = [*app.backend.engine.suppressed_ids, *app.backend.engine.eos_ids]
    banned_ids = torch.tensor(banned, device=app.backend.engine.runner.device)
    graphed = runner(app, cuda_graphs=True, chats=4)
    assert graphed.decode_graphs.batches == [1, 2, 4]

    together = greedy_together(graphed, prompts, steps, banned_ids)

    assert together == greedy_in_turns(graphed, prompts, steps, banned_ids)
    assert together == [generate(app, prompt, steps, banned) for prompt in prompts]


@contextmanager
def replays(graphs: BatchGraphs) -> Iterator[list[tuple[int, int, int]]]:
    """(sequences, first start, new tokens) of each call `graphs` replays meanwhile."""
    calls, replay = [], graphs.replay
    graphs.replay = lambda tables, x, starts, positions: calls.append((len(tables), starts[0], x.shape[1])) or replay(
        tables, x, starts, positions)
    try:
        yield calls
    finally:
        del graphs.replay


def test_chats_sent_at_once_through_the_engine_decode_as_one_batch_and_get_the_replies_of_generate(on_gpu):
    app = on_gpu
    texts = ["Tell me about lighthouses.", "What do fishermen sing?", "Describe the harbour at night."]
    with replays(app.backend.engine.runner.decode_graphs) as steps:
        requests = [app.session().send(text, max_new_tokens=24) for text in texts]
        finals = [request.result() for request in requests]
    # Each turn prefills one of them, so the first two already decode together while the third starts.
    assert max(chats for chats, _, _ in steps) > 1, "the chats must decode together"
    for text, final in zip(texts, finals):
        assert final.token_ids == reference_tokens(app, [Message("user", [text])])


@contextmanager
def syncs_forbidden() -> Iterator[None]:
    """Meanwhile, a CUDA call that makes the host wait for the device raises. (A CUDA event's
    synchronize is not one: the engine's late read of a step waits that way, outside the launch.)"""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def test_the_engine_queues_the_decode_steps_of_a_batch_without_ever_waiting_for_the_device(on_gpu, monkeypatch):
    engine = on_gpu.backend.engine
    with syncs_forbidden(), pytest.raises(RuntimeError, match="synchronizing"):
        torch.ones(1, device=engine.runner.device).item()  # the check is live
    decode, batches, all_sent = engine._decode, [], threading.Event()

    def decode_forbidding_syncs(requests):
        all_sent.wait(timeout=30)  # the first chat's first step waits for the others, so they overlap
        with syncs_forbidden():
            step = decode(requests)
        batches.append(len(requests))
        return step

    monkeypatch.setattr(engine, "_decode", decode_forbidding_syncs)
    # The demo model's replies can end at once; without an end of turn each decodes all its tokens.
    monkeypatch.setattr(engine, "eos_ids", set())
    # Greedy, sampled with top-k, and sampled with top-p and a repetition penalty, in one batch.
    options = [{}, {"temperature": 0.8, "top_k": 40, "seed": 1},
               {"temperature": 1.0, "top_p": 0.9, "repetition_penalty": 1.1, "seed": 2}]
    requests = [on_gpu.session().send(f"Question {i}: tell me about the sea.", max_new_tokens=12, **chosen)
                for i, chosen in enumerate(options)]
    all_sent.set()
    finals = [request.result() for request in requests]  # a synchronising call fails its requests
    assert max(batches) == 3, "the three chats must decode together"
    assert all(final.tokens.generated == 12 for final in finals)


@pytest.mark.parametrize("speaking", [False, True], ids=["text", "with the Talker's rows"])
def test_a_text_prompt_is_prefilled_and_its_first_token_chosen_without_waiting_for_the_device(
    speaking, request, monkeypatch,
):
    # A wait there holds back the next decode step of every other chat until the prompt's work
    # queued so far is done: measured, a 2,123-token prompt's last part stopped another chat's
    # tokens for 25 ms more than its chunk took. Where the app speaks, the prefill writes each
    # token's Talker row too.
    app = request.getfixturevalue("speaking_graphed_and_eager")[0] if speaking else request.getfixturevalue("on_gpu")
    engine = app.backend.engine
    prefill, parts = engine._prefill, []

    def prefill_forbidding_syncs(turn_parts):
        with syncs_forbidden():
            prefill(turn_parts)
        parts.extend(part.end for part in turn_parts)

    monkeypatch.setattr(engine, "_prefill", prefill_forbidding_syncs)
    monkeypatch.setattr(engine, "eos_ids", set())
    final = app.session().send("Tell me about the sea, with a repeat penalty.", max_new_tokens=4,
                               repetition_penalty=1.1).result()  # a synchronising call fails it
    assert parts and final.tokens.generated == 4


def test_a_chats_second_turn_on_the_prefix_cache_matches_generate_with_graphs_on(on_gpu):
    app = on_gpu
    with replays(app.backend.engine.runner.prefill_graphs) as prefills:
        session = app.session(system_prompt="You answer in one sentence.")
        for text in ["Tell me about lighthouses.", "And about the ships they guide?"]:
            before = list(session.history)
            final = session.send(text, max_new_tokens=24).result()
            assert final.token_ids == reference_tokens(app, [*before, Message("user", [text])])
    assert final.tokens.reused_gpu > 0, "the second turn must continue the first turn's KV"
    assert prefills[-1] == (1, final.tokens.reused_gpu, final.tokens.computed), "its prefill must replay a graph"


def test_a_long_second_turn_replays_the_one_graph_of_its_length_over_every_row_and_matches_generate(on_gpu):
    app = on_gpu
    graphs = app.backend.engine.runner.prefill_graphs
    largest = app.backend.engine.runner.kv.shape.max_tokens
    # Under our kernel a short tail's graphs are per bucket of rows; a longer one's walk only their rows.
    assert graphs.bucket(1, 16, 1)[2] == SMALLEST_BUCKET
    assert graphs.bucket(1, 2 * SPLIT_TAIL_TOKENS, 1)[2] == largest
    question = " ".join(f"Ship {i} flies a flag of two colours." for i in range(12))  # about 130 tokens
    with replays(graphs) as prefills:
        session = app.session()
        for text in ["Tell me about lighthouses.", question]:
            before = list(session.history)
            final = session.send(text, max_new_tokens=24).result()
            assert final.token_ids == reference_tokens(app, [*before, Message("user", [text])])
    n = final.tokens
    assert n.reused_gpu > 0 and n.computed > SPLIT_TAIL_TOKENS, "the second turn must be a long tail on the first's KV"
    assert prefills[-1] == (1, n.reused_gpu, n.computed), "its prefill must replay a graph"


def test_an_image_question_prefilled_by_a_graph_matches_generate(on_gpu):
    app = on_gpu
    parts = [picture(2), "What is in this picture?"]
    with replays(app.backend.engine.runner.prefill_graphs) as prefills:
        final = app.session().send(parts[1], images=[parts[0]], max_new_tokens=24).result()
    n = final.tokens
    assert final.media.in_kv == 0, "the image must be in the prefill"
    assert prefills == [(1, n.prompt - n.computed, n.computed)], "its prefill must replay a graph"
    assert final.token_ids == reference_tokens(app, [Message("user", parts)])


def test_a_first_prompt_longer_than_a_chunk_is_one_graph_attending_over_its_own_rows_and_matches_generate(on_gpu):
    app = on_gpu
    graphs = app.backend.engine.runner.prefill_graphs
    text = " ".join(f"Rule {i}: answer the sailor plainly." for i in range(30))  # about 700 tokens
    with replays(graphs) as prefills:
        final = app.session().send(text, max_new_tokens=24).result()
    n = final.tokens
    assert n.prompt > app.settings.prefill_chunk_tokens
    assert prefills == [(1, 0, n.prompt)], "one forward, replayed"
    # Its graph reads no rows but its own; the same tokens after a cached row read a bucket of rows.
    assert graphs.bucket(1, n.prompt, 0)[2] == NO_PREFIX and graphs.bucket(1, n.prompt, 1)[2] > n.prompt
    assert final.token_ids == reference_tokens(app, [Message("user", [text])])


def test_an_app_serving_before_its_prefill_graphs_answers_eagerly_as_generate_then_replays_them_once_warm(
    on_gpu, demo_settings, monkeypatch
):
    # The worker's first capture waits until the question is in its line: it captures that one (the
    # largest) and then serves the question, eagerly, before the rest.
    asked, capture = threading.Event(), ThinkerRunner.capture_a_prefill_graph
    monkeypatch.setattr(ThinkerRunner, "capture_a_prefill_graph", lambda runner: asked.wait(60) and capture(runner))
    text = "Tell me about lighthouses."
    with OmniLocal(demo_settings, wait_for_graphs=False) as app:
        engine = app.backend.engine
        assert engine.runner.decode_graphs is not None and engine.runner.prefill_graphs_left > 1
        with replays(engine.runner.prefill_graphs) as early_prefills:
            early = app.session().send(text, max_new_tokens=24)
            until(lambda: engine.queued or engine.scheduler.waiting or engine.scheduler.running,
                  "the question must reach the engine's line")
            asked.set()
            early = early.result()
        assert engine.warm.wait(timeout=300) and engine.runner.prefill_graphs_left == 0
        with replays(engine.runner.prefill_graphs) as late_prefills:
            late = app.session().send(text, max_new_tokens=24).result()
        n = late.tokens
        assert early_prefills == [] and late_prefills == [(1, n.prompt - n.computed, n.computed)]
        assert early.token_ids == late.token_ids == reference_tokens(app, [Message("user", [text])])


@pytest.fixture(scope="module")
def chunking_on_gpu(on_gpu, demo_settings) -> Iterator[OmniLocal]:
    """The demo on the GPU, cutting every prefill into chunks of 32 tokens: its prefill graphs are of
    32 new tokens at most."""
    with OmniLocal(demo_settings.replace(prefill_chunk_tokens=32, chunk_every_prefill=True)) as app:
        yield app


def test_an_image_question_across_a_chunk_boundary_replays_a_graph_for_each_chunk_and_matches_generate(
    chunking_on_gpu,
):
    app = chunking_on_gpu
    parts = [picture(2, (224, 224)), "What is in this picture?"]
    image = build_prompt([Message("user", parts)], app.backend.loaded.processor).media[0]
    chunk = app.settings.prefill_chunk_tokens
    assert image.start // chunk < (image.end - 1) // chunk, "the image must straddle a chunk boundary"
    with replays(app.backend.engine.runner.prefill_graphs) as prefills:
        final = app.session().send(parts[1], images=[parts[0]], max_new_tokens=24).result()
    n = final.tokens
    assert n.computed == n.prompt, "the whole prompt, the image in it, must be in the prefill"
    assert prefills == [(1, begin, min(begin + chunk, n.prompt) - begin) for begin in range(0, n.prompt, chunk)]
    assert final.token_ids == reference_tokens(app, [Message("user", parts)])


def test_a_spoken_reply_whose_talker_rows_cross_a_bucket_boundary_has_the_codes_of_eager_and_generate(
    speaking_graphed_and_eager,
):
    graphed, eager = speaking_graphed_and_eager
    assert graphed.backend.engine.speaker.runner.step_graphs is not None
    assert eager.backend.engine.speaker.runner.step_graphs is None
    text = text_under_bucket(graphed, STORY)
    sessions = [app.session() for app in (graphed, eager)]
    (final, frames, _, _), (_, eager_frames, _, _) = (
        send(app, session, text, voice="Chelsie") for app, session in zip((graphed, eager), sessions)
    )
    # The prefill makes the first frame; each later frame is a step that writes the next row.
    last_row = final.speech.talker_prompt + final.speech.frames - 2
    assert final.speech.talker_prompt < SMALLEST_BUCKET <= last_row
    assert frames == eager_frames
    assert frames == transformers_speech(graphed, [Message("user", [text])], "Chelsie")[1].T.tolist()
    # Turn 2 continues turn 1's Talker rows from the cache, all of its steps in the second bucket.
    second = [send(app, session, "And then?", voice="Chelsie") for app, session in zip((graphed, eager), sessions)]
    assert second[0][0].speech.talker_reused > 0
    assert second[0][1] == second[1][1]


def test_a_spoken_reply_queues_each_frame_after_the_talkers_prefill_without_waiting_for_the_device(
    speaking_graphed_and_eager, monkeypatch,
):
    # A wait in a frame leaves the device idle while the host queues the rest of the turn: measured,
    # speech held the Thinker at 15.7 ms a token against its 4 ms step
    # (docs/benchmarks/2026-12-02-rows-again-video-traced.md).
    speaker = speaking_graphed_and_eager[0].backend.engine.speaker
    queue_steps, checked = speaker._queue_steps, []

    def queue_steps_forbidding_syncs(stepping):  # every frame but the first, which is the Talker's prefill
        with syncs_forbidden():
            queue_steps(stepping)
        checked.append(len(stepping))

    monkeypatch.setattr(speaker, "_queue_steps", queue_steps_forbidding_syncs)
    app = speaking_graphed_and_eager[0]
    final, frames, _, _ = send(app, app.session(), STORY, voice="Chelsie")  # a synchronising call fails it
    assert final.speech.frames == len(frames) > 2 and sum(checked) >= len(frames) - 1
