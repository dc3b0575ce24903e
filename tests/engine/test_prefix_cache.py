"""The prefix cache never changes an answer, and its hits are real: each cached run equals the same
run with the cache off, token for token, and computes exactly the tokens no entry could supply."""

import io
import random

import pytest

from chats import Chat, common_prefix, written
from kv_budget import kv_rows
from samples import clip, picture
from omni_local.api import OmniLocal, Session
from omni_local.engine.prompt.builder import build_prompt
from omni_local.protocol.messages import Message

TOKEN_BYTES = 2048  # the demo's KV per token: 4 layers x K and V x 2 heads x 32 x float32


def ids_of(app: OmniLocal, session: Session, text: str, **media) -> list[int]:
    """The ids the next `send(text, **media)` of `session` will prompt with."""
    parts = [*media.get("images", []), *media.get("audio", []), text]
    return build_prompt([*session.history, Message("user", parts)], app.backend.loaded.processor).input_ids[0].tolist()


@pytest.mark.parametrize("kind", ["images", "audio"])
def test_the_same_medium_with_a_new_question_computes_only_the_new_question(apps, kind):
    media = {kind: [picture(1) if kind == "images" else clip(3)]}
    Chat(apps, "You look and listen.").send("What is this?", **media)
    second = Chat(apps, "You look and listen.")
    ids = ids_of(apps[0], second.cached, "What stands out?", **media)
    before = ids_of(apps[0], apps[0].session("You look and listen."), "What is this?", **media)
    final = second.send("What stands out?", **media)
    assert final.tokens.computed == len(ids) - common_prefix(ids, before)
    medium_end = build_prompt(second.cached.history[:2], apps[0].backend.loaded.processor).media[0].end
    assert final.tokens.reused_gpu > medium_end  # the medium's tokens came from the cache


def test_image_chat_turn_2_computes_only_turn_2(apps):
    chat = Chat(apps, "You describe pictures in detail.")
    first = chat.send("Describe this.", images=[picture(2, (160, 120))])
    second = chat.send("And what is in the corner?")
    assert second.tokens.computed == second.tokens.prompt - written(first)
    assert second.tokens.reused_gpu == written(first)


def test_text_chat_turns_2_to_5_each_compute_only_their_new_tokens(apps):
    chat = Chat(apps, "You chat about the sea.")
    previous = chat.send("Tell me about waves.")
    for question in ("Why are they salty?", "What lives deep down?", "How deep is it?", "Thank you!"):
        final = chat.send(question)
        assert final.tokens.computed == final.tokens.prompt - written(previous)
        previous = final


def test_a_resend_whose_cached_prefix_ends_just_before_an_image_starts_the_tail_at_the_image(apps):
    Chat(apps, "You compare pictures.").send("What is this?", images=[picture(4)])
    second = Chat(apps, "You compare pictures.")
    other = picture(5)  # same size, other pixels: same placeholder ids, other digest
    final = second.send("What is this?", images=[other])
    prompt = build_prompt([*second.cached.history[:1], *second.cached.history[1:2]], apps[0].backend.loaded.processor)
    image_start = prompt.media[0].start
    assert final.tokens.computed == final.tokens.prompt - image_start


def test_two_sessions_share_a_500_token_system_prompt_and_then_diverge_independently(apps):
    system = " ".join(f"Rule {i}: be kind to the reader and answer plainly." for i in range(18))
    first, second = Chat(apps, system), Chat(apps, system)
    first_ids = ids_of(apps[0], first.cached, "Hello!")
    assert first.send("Hello!").tokens.prompt > 500
    second_ids = ids_of(apps[0], second.cached, "Good morning!")
    two = second.send("Good morning!")
    assert two.tokens.reused_gpu == common_prefix(second_ids, first_ids) > 500
    # Each goes on its own way: equal to its cache-off run, so neither's writes reach the other.
    first.send("What is rule 3?")
    second.send("Which rule matters most?")


def test_editing_turn_1_of_three_reuses_everything_before_the_edit(apps):
    chat = Chat(apps, "You answer questions about birds.")
    session = apps[0].session("You answer questions about birds.")
    original_ids = ids_of(apps[0], session, "Why do birds sing in the morning?")
    for question in ("Why do birds sing in the morning?", "Which bird sings best?", "Do owls sing?"):
        chat.send(question)
    chat.edit_from(0)
    edited_ids = ids_of(apps[0], chat.cached, "Why do birds fly south?")
    final = chat.send("Why do birds fly south?")
    assert final.tokens.computed == len(edited_ids) - common_prefix(edited_ids, original_ids)


def test_regenerating_the_last_reply_reuses_the_whole_prompt_but_its_last_token(apps):
    chat = Chat(apps, "You write haiku.")
    chat.send("A haiku about rain.")
    chat.edit_from(0)
    final = chat.send("A haiku about rain.")
    assert final.tokens.computed == 1


@pytest.fixture(scope="module")
def small_apps(demo_settings, demo_checkpoint):
    """KV for two of these tests' chats on the device (6 blocks: 3 each, a prompt of 30 to 40 tokens
    and 6 reply tokens); host memory for a few entries, or none."""
    two_chats = kv_rows(demo_settings, 96)
    with (
        OmniLocal(two_chats.replace(host_cache_bytes=1 << 20)) as with_host,
        OmniLocal(two_chats.replace(host_cache_bytes=0)) as without_host,
        OmniLocal(two_chats.replace(prefix_cache=False, encoder_cache=False)) as uncached,
    ):
        yield with_host, without_host, uncached


def test_a_session_resumes_from_host_memory_after_its_entry_moved_there(small_apps):
    with_host, _, uncached = small_apps
    # C shares more with B than with A, so A is the one that makes room.
    a = Chat((with_host, uncached), "Apples are the topic.")
    first = a.send("Tell me about apples.")
    Chat((with_host, uncached), "Session B talks about bread.").send("Tell me about bread.")
    Chat((with_host, uncached), "Session C talks about cheese.").send("Tell me about cheese.")
    entry = with_host.backend.engine.cache.entry(a.cached.id)
    assert entry.table is None and entry.host is not None  # moved off the device to make room
    final = a.send("And green ones?")
    assert final.tokens.reused_host == written(first)
    assert final.tokens.computed == final.tokens.prompt - written(first)


def test_a_session_whose_entry_was_dropped_reuses_only_what_is_still_on_the_device(small_apps):
    _, without_host, uncached = small_apps
    a = Chat((without_host, uncached), "Apples only.")
    a.send("Tell me about apples.")
    b = Chat((without_host, uncached), "Session B: bread only.")
    b.send("Tell me about bread.")
    c = Chat((without_host, uncached), "Session C: cheese only.")
    c.send("Tell me about cheese.")
    assert without_host.backend.engine.cache.entry(a.cached.id) is None  # dropped: no host memory
    ids = ids_of(without_host, a.cached, "And green ones?")
    shared = max(common_prefix(ids, ids_of(without_host, other.cached, "")) for other in (b, c))
    final = a.send("And green ones?")  # the same answer as the uncached app's (Chat checks)
    assert final.tokens.reused_host == 0
    # Another chat's prefix (the template's opening), or the dropped entry's first blocks where no
    # chat has been handed them since, found by hash.
    reused = final.tokens.reused_gpu
    assert reused == shared or (reused % without_host.settings.kv_block_tokens == 0 and reused > shared)
    assert final.tokens.computed == len(ids) - reused


def test_200_requests_over_20_sessions_stay_within_both_budgets_and_leave_nothing_pinned(demo_settings):
    gpu_budget = 3 * demo_settings.max_context_tokens * TOKEN_BYTES
    host_budget = 400 * TOKEN_BYTES
    settings = demo_settings.replace(gpu_cache_bytes=gpu_budget, host_cache_bytes=host_budget)
    rng = random.Random(0)
    with OmniLocal(settings) as app:
        cache, kv = app.backend.engine.cache, app.backend.engine.runner.kv
        sessions = [app.session(f"Session {i} is about topic {i}.") for i in range(20)]
        for n in range(200):
            session = rng.choice(sessions)
            reply = session.send(f"Question {n}?", max_new_tokens=3)
            if n % 7 == 0:
                reply.cancel()
            reply.result()
            assert kv.allocated_bytes <= gpu_budget
            assert cache.gpu_bytes <= gpu_budget
            assert cache.host_bytes <= host_budget
            if len(session.history) > 12:
                del session.history[1:]  # keep prompts short
        assert all(entry.pins == 0 for entry in cache.entries.values())


def test_the_same_picture_as_png_and_as_lossless_webp_hits_one_entry_but_a_changed_pixel_does_not(apps, tmp_path):
    image = picture(6)
    image.save(tmp_path / "a.png")
    image.save(tmp_path / "b.webp", lossless=True)
    changed = image.copy()
    changed.putpixel((0, 0), (1, 2, 3))
    changed.save(tmp_path / "c.png")
    Chat(apps, "You look closely.").send("What is this?", images=[tmp_path / "a.png"])
    same = Chat(apps, "You look closely.").send("What is this?", images=[tmp_path / "b.webp"])
    assert same.tokens.computed == 1
    other = Chat(apps, "You look closely.")
    final = other.send("What is this?", images=[tmp_path / "c.png"])
    start = build_prompt(other.cached.history[:2], apps[0].backend.loaded.processor).media[0].start
    assert final.tokens.computed == final.tokens.prompt - start


def test_with_the_cache_off_nothing_is_kept(apps):
    _, uncached = apps
    Chat(apps).send("Anything kept?")
    assert uncached.backend.engine.cache.entries == {}
    assert uncached.backend.engine.runner.kv.pool.free == uncached.backend.engine.runner.kv.pool.usable


def test_bytes_of_a_png_are_decoded_before_keying(apps):
    buffer = io.BytesIO()
    picture(7).save(buffer, format="PNG")
    Chat(apps, "Bytes.").send("What?", images=[buffer.getvalue()])
    again = Chat(apps, "Bytes.").send("What?", images=[picture(7)])
    assert again.tokens.computed == 1


@pytest.mark.parametrize("block_tokens", [1, 4, 64])
def test_with_blocks_of_any_size_chats_sharing_a_system_prompt_and_an_image_compute_only_what_is_new(
        make_apps, demo_settings, block_tokens):
    apps = make_apps(demo_settings.replace(kv_block_tokens=block_tokens))
    system = " ".join(f"Rule {i}: answer plainly." for i in range(8))
    first, second = Chat(apps, system), Chat(apps, system)
    before = ids_of(apps[0], first.cached, "What is this?", images=[picture(8)])
    last = {first: first.send("What is this?", images=[picture(8)])}
    ids = ids_of(apps[0], second.cached, "What stands out?", images=[picture(8)])
    last[second] = second.send("What stands out?", images=[picture(8)])  # its prefix from the other chat's blocks
    assert last[second].tokens.computed == len(ids) - common_prefix(ids, before)
    for chat, question in ((first, "And the colours?"), (second, "And the shapes?"), (first, "Thanks!")):
        turn = chat.send(question)  # only its own tokens, and the cache-off app's answer (Chat checks)
        assert turn.tokens.computed == turn.tokens.prompt - written(last[chat])
        last[chat] = turn
