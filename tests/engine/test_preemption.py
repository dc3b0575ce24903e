"""A written reply claims KV blocks for its prompt and the start of its reply, and more as it grows.
When replies running together outgrow the pool, the youngest is preempted: its rows wait in host
memory, its seat kept, and it resumes once blocks free. Each reply's tokens are those it has alone."""

from unittest.mock import patch

import pytest

from omni_local.api import OmniLocal
from omni_local.engine.scheduler import REPLY_ROWS_AHEAD

REPLY = 600  # tokens each reply decodes: each fits the pool alone, not two side by side
# (question, sampling): the demo's replies to these run to REPLY tokens; the sampled one checks that
# a preempted reply's random stream goes on where it stopped.
ASKED = [("What do fishermen sing at night?", {"temperature": 0.0}), ("Hello.", {"temperature": 0.0}),
         ("Describe the harbour at night.", {"temperature": 1.0, "seed": 7})]


@pytest.fixture(scope="module")
def small_pool(demo_settings, demo_checkpoint):
    """The demo with blocks for about 1,000 tokens: one reply of REPLY tokens fits, two do not."""
    settings = demo_settings.replace(prefix_cache=False, encoder_cache=False)
    with OmniLocal(settings) as probe:
        block_bytes = probe.backend.engine.runner.kv.shape.block_bytes(probe.backend.engine.runner.dtype)
    with OmniLocal(settings.replace(gpu_cache_bytes=65 * block_bytes)) as app:  # 64 blocks and the pad block
        yield app


def test_replies_outgrowing_the_pool_together_give_the_tokens_they_give_alone_the_youngest_preempted(small_pool):
    app = small_pool
    engine = app.backend.engine
    assert engine.runner.kv.capacity_tokens < 2 * REPLY < 2 * engine.runner.kv.capacity_tokens
    alone = [app.session().send(q, max_new_tokens=REPLY, **sampling).result() for q, sampling in ASKED]
    assert all(final.tokens.generated == REPLY for final in alone), "the comparison needs replies that run long"

    with patch.object(engine.cache, "park", wraps=engine.cache.park) as parked, \
            patch.object(engine.cache, "resume", wraps=engine.cache.resume) as resumed:
        requests = [app.session().send(q, max_new_tokens=REPLY, **sampling) for q, sampling in ASKED]
        together = [request.result() for request in requests]

    assert parked.call_count >= 1 and resumed.call_count >= 1, "one must have been preempted and resumed"
    assert [final.token_ids for final in together] == [final.token_ids for final in alone]
    assert engine.runner.kv.pool.held == 0, "every block given back"


def test_a_written_reply_claims_its_prompt_and_the_start_of_its_reply_and_a_spoken_one_all_of_it(small_pool):
    engine = small_pool.backend.engine
    claims = []
    claim = engine.cache.claim

    def recording_claim(session, prompt, match, rows, at_most=None, **principal):
        claims.append((prompt.num_tokens, rows, at_most))
        return claim(session, prompt, match, rows, at_most, **principal)

    with patch.object(engine.cache, "claim", recording_claim):
        small_pool.session().send("Hello.", max_new_tokens=200, temperature=0.0).result()
    ((prompt, rows, at_most),) = claims
    assert (rows, at_most) == (prompt + REPLY_ROWS_AHEAD, prompt + 200)
