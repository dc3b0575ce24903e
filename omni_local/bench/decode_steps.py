"""The Thinker's decode step alone: one step of B chats decoding together, against B and context.

    python -m omni_local.bench.decode_steps                                # demo model, CPU smoke run
    python -m omni_local.bench.decode_steps --random-weights CONFIG.json   # full size, random weights
    python -m omni_local.bench.decode_steps --random-weights CONFIG.json --moe-backend torch --chats 1 16

Any setting can be given as for the app: `--moe-backend torch|triton` picks what runs the experts
(`auto`, the default, is triton on a GPU); `--chats` and `--contexts` pick the table's rows and columns.

The main bench's ITL at c8 or c16 also holds the other chats' prefills, which stall every reply
while the chats start; this is the steady state after that, when nothing but decoding runs: the time
per token each chat sees. Each chat decodes at row `context - 1` of its own blocks, attending over
the rows before it as they are (their values do not change the time); the step is timed as the
median of --runs after a warm-up step. B chats of C rows need about B x C rows of KV: pass
--gpu-cache-bytes for the largest (16 chats of 4,096 rows: 6 GiB at full size).

The chats are distinct, as real users' are: each decodes its own token (spread over the vocabulary)
at its own row (spread evenly over C x 7/8 to C x 9/8; one chat decodes at row C - 1). Identical
rows would route to the same experts, so a step of 16 identical chats reads the experts of one
(8 a layer) where 16 real chats read about 82 of the 128: a figure no user sees.

Each step is timed alone by default: the host's work before it (the step's inputs, the graph's
launch) is in its time, then the host waits for the device. The engine does not wait: it queues a
step, then reads the step before, so with graphs the device runs step after step while the host
prepares the next. `--queued` times steps that way: --runs steps queued back to back between two
waits, their mean; the median of five such rounds. That is the time per token a chat sees while
the host keeps ahead of the device, without the host's jitter in it.
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

import numpy as np
import torch

from omni_local.api import OmniLocal
from omni_local.bench.common import bench_parser, median_wall_ms, settings_and_model
from omni_local.engine.forward.thinker import ThinkerRunner
from omni_local.engine.memory.kv_store import BlockTable, KVStore

BATCHES = [1, 2, 4, 8, 16]
CONTEXTS = [256, 1024, 4096]
QUEUED_ROUNDS = 5  # --queued: rounds of --runs steps each
SPREAD = 8  # chats' contexts lie within context / SPREAD of the column's


def chat_contexts(batch: int, context: int) -> list[int]:
    """The rows of context each of `batch` chats has: spread evenly around `context`, `context` itself
    for one chat."""
    if batch == 1:
        return [context]
    return [round(c) for c in np.linspace(context - context / SPREAD, context + context / SPREAD, batch)]


def chat_tokens(batch: int, vocab: int) -> list[int]:
    """A distinct token for each of `batch` chats, drawn over the whole vocabulary (the same every run)."""
    return np.random.default_rng(batch).choice(vocab, batch, replace=False).tolist()


@contextmanager
def held_tables(kv: KVStore, contexts: list[int]) -> Iterator[list[BlockTable]]:
    """A block table for each chat, of its context's rows, from the store's free blocks (the
    Thinker's, or the Talker's), given back after. The engine's worker is idle: the blocks it does
    not hold are ours for the steps."""
    tables = [kv.take(kv.shape.blocks_for(context)) for context in contexts]
    try:
        yield tables
    finally:
        for table in tables:
            kv.pool.release(table)


def within_context(runner: ThinkerRunner, context: int) -> bool:
    """Whether the chats spread around `context` stay within a sequence's rows."""
    return context + context / SPREAD <= runner.kv.shape.max_tokens


def fits(runner: ThinkerRunner, batch: int, context: int) -> bool:
    """Whether `batch` chats around `context` rows fit the free blocks and the decode step's batch."""
    kv = runner.kv
    return batch <= runner.max_batch and sum(map(kv.shape.blocks_for, chat_contexts(batch, context))) <= kv.pool.free


def decode_step(runner: ThinkerRunner, tables: list[BlockTable], contexts: list[int]) -> Callable[[], object]:
    """The step timed here: each chat decodes its own token at the last row of its context."""
    tokens = chat_tokens(len(tables), runner.model.get_input_embeddings().num_embeddings)
    return partial(runner.decode, tables, tokens, [c - 1 for c in contexts], [0] * len(tables))


def device_label(runner: ThinkerRunner) -> str:
    return f"device {torch.cuda.get_device_name() if runner.device.type == 'cuda' else 'cpu'}, dtype {runner.dtype}"


def step_ms(runner: ThinkerRunner, batch: int, context: int, runs: int, queued: bool = False) -> float:
    contexts = chat_contexts(batch, context)
    with held_tables(runner.kv, contexts) as tables:
        step = decode_step(runner, tables, contexts)
        if not queued:
            return median_wall_ms(step, runs)
        return median_wall_ms(lambda: [step() for _ in range(runs)], QUEUED_ROUNDS) / runs


def main() -> None:
    parser = bench_parser("python -m omni_local.bench.decode_steps")
    parser.add_argument("--chats", type=int, nargs="+", default=BATCHES, help="chats decoding together (rows)")
    parser.add_argument("--contexts", type=int, nargs="+", default=CONTEXTS, help="rows of context (columns)")
    parser.add_argument("--queued", action="store_true", help="steps queued back to back, as the engine runs them")
    args = parser.parse_args()
    settings, loaded = settings_and_model(args)
    with OmniLocal(settings, loaded=loaded) as app:
        runner = app.backend.engine.runner
        contexts = [c for c in args.contexts if within_context(runner, c)]
        batches = [b for b in args.chats if fits(runner, b, max(contexts))]
        graphed = "graphed" if runner.decode_graphs is not None else "eager"
        deterministic = ", deterministic" if settings.deterministic else ""
        timing = (f"mean of {args.runs} queued back to back, median of {QUEUED_ROUNDS} rounds" if args.queued
                  else f"median of {args.runs}")
        print(f"Thinker decode step ({graphed}, MoE backend {runner.regions.moe.name}{deterministic}), ms per step, "
              f"{timing}; distinct chats, contexts within 1/{SPREAD} of the column's; {device_label(runner)}\n")
        print("| chats | " + " | ".join(f"context {c}" for c in contexts) + " |")
        print("| --- |" + " --- |" * len(contexts))
        for batch in batches:
            cells = [f"{step_ms(runner, batch, context, args.runs, args.queued):.2f}" for context in contexts]
            print(f"| {batch} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
