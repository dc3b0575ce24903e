"""How the engine serves requests: sampling, streaming, cancellation, failures, several at once."""

import threading

import pytest
import torch

import omni_local.engine.inbox as inbox_module
from kv_budget import kv_rows
from omni_local.api import OmniLocal
from omni_local.bench.beside import accepted_tokens
from omni_local.errors import RequestError
from omni_local.model.loader import end_of_turn_ids
from omni_local.protocol.events import Finished, TextDelta
from waiting import came_true, within

QUESTION = "Tell me a story about a lighthouse keeper."


@pytest.fixture
def gated_decode(app: OmniLocal, monkeypatch):
    """Replace the runner's decode with one that calls `gate(step)` before each decode step."""

    def install(gate):
        original = app.backend.engine.runner.decode
        calls = []

        def decode(*args, **kwargs):
            calls.append(args)
            gate(len(calls))
            return original(*args, **kwargs)

        monkeypatch.setattr(app.backend.engine.runner, "decode", decode)
        return calls

    return install


def no_entry_is_pinned(app: OmniLocal) -> bool:
    return all(entry.pins == 0 for entry in app.backend.engine.cache.entries.values())


def test_sampling_with_a_seed_is_reproducible_and_seeds_differ(app):
    def sample(seed: int) -> list[int]:
        reply = app.session().send(QUESTION, temperature=1.0, top_p=0.95, top_k=50, max_new_tokens=16, seed=seed)
        return reply.result().token_ids

    first, again, other = sample(1), sample(1), sample(2)
    assert first == again
    assert first != other


def test_the_seed_of_a_sampled_reply_is_reported_and_reproduces_it(app):
    final = app.session().send(QUESTION, temperature=0.8, max_new_tokens=12).result()
    again = app.session().send(QUESTION, temperature=0.8, max_new_tokens=12, seed=final.seed).result()
    assert again.token_ids == final.token_ids


def test_text_deltas_arrive_before_the_request_ends(app, gated_decode):
    first_delta_seen = threading.Event()
    waited = []
    # The second decode step waits until the caller holds a delta: a reply that only arrived at
    # the end would make this wait time out.
    gated_decode(lambda step: waited.append(first_delta_seen.wait(timeout=20)) if step == 2 else None)
    deltas = []
    final = None
    for event in app.session().send(QUESTION, max_new_tokens=12):
        if isinstance(event, TextDelta):
            deltas.append(event.text)
            first_delta_seen.set()
        else:
            final = event
    assert waited == [True]
    assert final.tokens.generated == 12
    assert "".join(deltas) == final.text


def test_a_request_cancelled_after_three_tokens_yields_no_more_and_the_next_is_served(app, gated_decode):
    replies = []

    def cancel_before_the_fourth_token(step: int) -> None:
        # Step 4 is queued before the host reads step 3: by then the prefill made token 1, decode
        # steps 1 and 2 tokens 2 and 3, and the fourth (step 3's) is not read yet.
        if step == 4:
            replies[0].cancel()

    calls = gated_decode(cancel_before_the_fourth_token)
    replies.append(app.session().send(QUESTION, max_new_tokens=50))
    events = list(replies[0])
    final = events[-1]
    assert isinstance(final, Finished) and final.stop_reason == "cancelled"
    assert final.tokens.generated == 3
    assert len(calls) == 4  # the step being queued ran; no other forward did
    assert "".join(e.text for e in events[:-1]) == final.text
    assert no_entry_is_pinned(app)
    assert app.session().send(QUESTION, max_new_tokens=5).result().tokens.generated == 5


def test_the_step_queued_after_a_reply_ended_leaves_no_token_and_no_counted_kv_row(app, monkeypatch):
    # The host reads each step's token one step late: the step after the end of turn (reading it)
    # has run before the host knows the reply ended.
    end_of_turn = end_of_turn_ids(app.backend.loaded.processor)[0]
    first_three = app.session().send(QUESTION, max_new_tokens=3).result().token_ids
    original, rows = app.backend.engine.runner.decode, []

    def decode(tables, tokens, indices, rope_deltas):
        rows.append(indices[0])
        logits = original(tables, tokens, indices, rope_deltas).clone()
        if len(rows) == 3:
            logits[:, end_of_turn] = logits.max() + 1  # decode step 3 chooses the end of turn
        return logits

    monkeypatch.setattr(app.backend.engine.runner, "decode", decode)
    session = app.session()
    final = session.send(QUESTION, max_new_tokens=20).result()
    prompt = final.tokens.prompt
    assert rows == [prompt, prompt + 1, prompt + 2, prompt + 3], "step 4 must have run, on the end of turn"
    assert final.stop_reason == "end_of_turn"
    assert final.token_ids == first_three and final.tokens.generated == 3
    monkeypatch.undo()
    # The next turn reuses the prompt and the three tokens, not the end of turn's row step 4 wrote.
    second = session.send("And then?", max_new_tokens=2).result()
    assert second.tokens.reused_gpu == prompt + 3


def test_a_prompt_over_the_limit_fails_with_a_clear_error_and_the_engine_serves_on(demo_settings):
    with OmniLocal(demo_settings.replace(max_prompt_tokens=40)) as app:
        with pytest.raises(RequestError, match=r"this message and the system prompt alone are [\d,]+ tokens, over the "
                                               r"limit of 40 \(max_prompt_tokens\)"):
            app.session().send("word " * 100).result()
        assert app.session().send("Hi", max_new_tokens=3).result().tokens.generated == 3


def test_out_of_memory_fails_only_that_request(app, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    original = app.backend.engine.runner.prefill
    monkeypatch.setattr(app.backend.engine.runner, "prefill", out_of_memory)
    with pytest.raises(RequestError, match="out of memory"):
        app.session().send(QUESTION).result()
    monkeypatch.setattr(app.backend.engine.runner, "prefill", original)
    assert app.session().send(QUESTION, max_new_tokens=4).result().tokens.generated == 4
    assert no_entry_is_pinned(app)  # the failed request let go of its blocks


def test_a_fault_of_the_engines_own_in_a_turn_fails_the_running_reply_and_the_engine_serves_on(app, monkeypatch):
    # Outside the guards of a turn's parts: the worker thread itself would die, and every reply,
    # those sent later included, would wait forever.
    plan, faults = app.backend.engine.scheduler.plan, []

    def plan_once_broken():
        if not faults:
            faults.append(1)
            raise KeyError("a fault of ours")
        return plan()

    monkeypatch.setattr(app.backend.engine.scheduler, "plan", plan_once_broken)

    def ask():
        return app.session().send(QUESTION, max_new_tokens=4).result()

    with pytest.raises(RequestError, match="internal error: KeyError"):
        within(ask, "the reply in the broken turn must fail, not wait")
    assert within(ask, "the next reply must be served").tokens.generated == 4
    assert no_entry_is_pinned(app)


def test_requests_from_several_threads_are_all_served_and_match_their_lone_answers(demo_settings):
    with OmniLocal(demo_settings.replace(max_running_requests=2)) as app:
        assert app.backend.engine.seats.count == 2
        alone = app.session().send(QUESTION, max_new_tokens=10).result().token_ids
        results = [None] * 6

        def ask(i: int) -> None:
            results[i] = app.session().send(QUESTION, max_new_tokens=10).result().token_ids

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]  # more requests than seats
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert app.backend.engine.seats.free == 2  # each reply gave its seat back as its text ended
    assert results == [alone] * 6


def test_the_final_event_counts_tokens_and_times_the_request(app):
    final = app.session().send(QUESTION, max_new_tokens=8).result()
    n = final.tokens
    assert n.prompt == n.computed + n.reused_gpu + n.reused_host and n.computed >= 1
    assert final.tokens.generated == len(final.token_ids) == 8
    assert final.stop_reason == "max_new_tokens"
    assert 0 <= final.timings.queue_wait_s <= final.timings.ttft_s
    assert final.timings.decode_tokens_per_s > 0


def test_bad_sampling_values_are_refused_before_anything_runs(app):
    with pytest.raises(RequestError, match="top_p must be in"):
        app.session().send(QUESTION, top_p=0)
    with pytest.raises(RequestError, match="unknown sampling parameter 'temprature'"):
        app.session().send(QUESTION, temprature=1.0)


def test_closing_the_engine_ends_a_reply_still_streaming_with_a_clear_error(demo_settings):
    app = OmniLocal(demo_settings)
    started = threading.Event()
    release = threading.Event()
    original = app.backend.engine.runner.decode

    def slow_decode(*args, **kwargs):
        started.set()
        release.wait(timeout=20)
        return original(*args, **kwargs)

    app.backend.engine.runner.decode = slow_decode
    reply = app.session().send(QUESTION, max_new_tokens=50)
    assert started.wait(timeout=20)
    closer = threading.Thread(target=app.close)
    closer.start()
    release.set()
    outcome = []

    def wait_for_the_reply() -> None:
        try:
            reply.result()
        except RequestError as error:
            outcome.append(str(error))

    waiter = threading.Thread(target=wait_for_the_reply, daemon=True)
    waiter.start()
    waiter.join(timeout=30)  # without an answer from the engine this would wait forever
    closer.join(timeout=30)
    assert outcome == ["the engine was closed"]


def test_a_request_waiting_for_blocks_is_not_matched_again_at_every_decode_step(demo_settings):
    with OmniLocal(kv_rows(demo_settings, 64)) as app:  # the first request's blocks are all there are
        matched = []
        match = app.backend.engine.cache.match
        app.backend.engine.cache.match = lambda prompt, *session: (matched.append(prompt.num_tokens)
                                                                   or match(prompt, *session))
        first = app.session().send(QUESTION, max_new_tokens=30)
        second = app.session().send("Another question entirely?", max_new_tokens=3)
        assert first.result().tokens.generated == 30 and second.result().tokens.generated == 3
    # The first request once; the second once while blocked, then once when blocks came free and
    # once more after its match (the first's entry, in those blocks) moved to host to make room.
    assert 3 <= len(matched) <= 4


def test_a_prompt_slow_to_build_holds_up_no_chat_that_is_decoding(app, monkeypatch):
    build = inbox_module.fit_prompt
    decoding = app.session()
    with accepted_tokens(app.backend.engine, decoding.id) as arrivals:
        kept_coming = []

        def slow_to_build(messages, *args):
            if "a long document" in messages[-1].text:  # say, a pasted document: tokenizing takes a while
                start = len(arrivals)
                kept_coming.append(came_true(lambda: len(arrivals) >= start + 5, seconds=10))
            return build(messages, *args)

        monkeypatch.setattr(inbox_module, "fit_prompt", slow_to_build)
        story = decoding.send(QUESTION, max_new_tokens=400)
        reader = threading.Thread(target=story.result, daemon=True)
        reader.start()
        assert came_true(lambda: len(arrivals) >= 2, seconds=30)
        asked = app.session().send("Here is a long document.", max_new_tokens=2)
        final = asked.result()
        story.cancel()
        reader.join(timeout=30)
    # While its prompt was being built, the other chat got five tokens more; then it was answered.
    assert kept_coming == [True] and final.tokens.prompt > 0
