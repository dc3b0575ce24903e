"""The speech path's parts for B replies speaking together: what one frame of each costs.

    python -m omni_local.bench.speech_steps                                        # demo model, CPU smoke run
    python -m omni_local.bench.speech_steps --random-weights CONFIG.json --weights int4 --replies 1 4 16

Each engine turn makes one frame (80 ms of audio) of every spoken reply: the Talker's step of them
all in one forward, then their code predictor's frames (15 steps each) in another, and, once a
reply has enough frames, a Code2Wav chunk of it. A row times each part for B replies, the median of
--runs after a warm-up, the host waiting for the device after each: the Talker's step (each reply
at its own row near --talker-rows, its own input row), the code predictor's frames (each reply its
own hidden state and first code), and B full Code2Wav chunks one after another, as the engine
decodes them (each `audio_chunk_frames` new frames after `audio_left_context_frames`, its own
codes). Replies speak in real time while a turn's parts take less than a frame's 80 ms. Settings
as for the app (speech is on): `--max-running-requests` is the largest batch a step or frame takes
at once.
"""

import numpy as np
import torch

from omni_local.api import OmniLocal
from omni_local.bench.common import bench_model, bench_parser, median_wall_ms
from omni_local.bench.decode_steps import held_tables
from omni_local.engine.forward.speech import Speaker
from omni_local.engine.forward.vocoder import AudioStream
from omni_local.model.loader import quiet_library_logs
from omni_local.protocol.params import SamplingParams
from omni_local.settings import settings_from_arguments

REPLIES = [1, 2, 4, 8, 16]
FRAME_MS = 80


def talker_step_ms(speaker: Speaker, replies: int, rows: int, runs: int) -> float:
    """The Talker's step of `replies` replies, each at its own row around `rows`, from its own input."""
    runner = speaker.runner
    indices = [rows + i for i in range(replies)]
    generator = torch.Generator().manual_seed(replies)
    embeds = torch.randn((replies, 1, runner.tts_pad.shape[-1]), generator=generator).to(runner.device, runner.dtype)
    with held_tables(runner.kv, [index + 1 for index in indices]) as tables:
        return median_wall_ms(lambda: runner.steps(tables, indices, embeds, [0] * replies), runs)


def frames_ms(speaker: Speaker, replies: int, runs: int) -> float:
    """The code predictor's frames of `replies` replies, each from its own hidden state and first code,
    their codes read."""
    runner = speaker.runner
    generator = torch.Generator().manual_seed(replies)
    hidden = torch.randn((replies, 1, runner.tts_pad.shape[-1]), generator=generator).to(runner.device, runner.dtype)
    vocab = runner.talker.codec_head.out_features
    firsts = torch.randint(0, vocab - 1024, (replies,), generator=generator).to(runner.device)
    params, seeds = [SamplingParams()] * replies, list(range(replies))

    def frames() -> None:
        codes, _ = runner.complete_frames(hidden, firsts, params, seeds, [0] * replies)
        for frame in codes:
            frame.tolist()

    return median_wall_ms(frames, runs)


def chunks_ms(speaker: Speaker, replies: int, chunk_frames: int, runs: int) -> float:
    """`replies` full Code2Wav chunks, one after another: each `chunk_frames` new frames of its own
    codes after its left context."""
    vocoder = speaker.vocoder
    context = vocoder.left_context
    rng = np.random.default_rng(replies)
    groups = speaker.runner.num_code_groups
    codebook = int(vocoder.code2wav.config.codebook_size)
    codes = [rng.integers(0, codebook, (context + chunk_frames, groups)).tolist() for _ in range(replies)]

    def decode_all() -> None:
        for frames in codes:
            vocoder.decode(AudioStream(frames=frames, decoded=context, sent=context * vocoder.samples_per_frame,
                                       chunks=8))

    return median_wall_ms(decode_all, runs)


def main() -> None:
    parser = bench_parser("python -m omni_local.bench.speech_steps")
    parser.add_argument("--replies", type=int, nargs="+", default=REPLIES, help="replies speaking together (rows)")
    parser.add_argument("--talker-rows", type=int, default=300, help="rows each reply's Talker sequence holds")
    args = parser.parse_args()
    quiet_library_logs()
    settings = settings_from_arguments(args).replace(speech=True)
    with OmniLocal(settings, loaded=bench_model(settings, args.random_weights)) as app:
        speaker = app.backend.engine.speaker
        runner, chunk = speaker.runner, speaker.vocoder.chunk
        graphed = "graphed" if runner.frame_graphs else "eager"
        device = torch.cuda.get_device_name() if runner.device.type == "cuda" else "cpu"
        print(f"The speech path's parts ({graphed}), ms, median of {args.runs}; Code2Wav chunks of {chunk} new frames "
              f"after {speaker.vocoder.left_context} of context; device {device}, dtype {runner.dtype}\n")
        print("| replies | Talker step | code predictor frames | Code2Wav chunks, one per reply | frame per reply "
              f"(step + frames), of {FRAME_MS} ms |")
        print("| --- | --- | --- | --- | --- |")
        for replies in (r for r in args.replies if r <= runner.max_batch):
            step = talker_step_ms(speaker, replies, args.talker_rows, args.runs)
            frames = frames_ms(speaker, replies, args.runs)
            chunks = chunks_ms(speaker, replies, chunk, args.runs)
            print(f"| {replies} | {step:.2f} | {frames:.2f} | {chunks:.2f} | {(step + frames) / replies:.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
