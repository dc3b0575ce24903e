"""Encoder time per image size and clip length, eager and compiled; the first image after start-up;
and preprocessing (the processor's resize, normalisation and patchifying) on the CPU and on the
model's device.

    python -m omni_local.bench.encoders                                # demo model, CPU smoke run
    python -m omni_local.bench.encoders --random-weights CONFIG.json   # full size, random weights
    python -m omni_local.bench.encoders --preprocessing-only           # the preprocessing rows alone

Each cell is the median of --runs after the compiled graphs were warmed up; start-up is the time
`OmniLocal` takes to come up (model already in memory), warm-up included, and the first image is
that app's time to first token for a 480x640 question.
"""

import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from PIL import Image

from omni_local.api import OmniLocal
from omni_local.bench.common import bench_parser, elapsed_s, median_wall_ms, settings_and_model
from omni_local.bench.scenarios import IMAGE_SIZES as SCENARIO_IMAGE_SIZES
from omni_local.bench.scenarios import noise_image, ten_second_video
from omni_local.engine.forward.encoders import Encoders
from omni_local.engine.prompt.encoder_inputs import audio_inputs, image_inputs, video_inputs
from omni_local.model.loader import LoadedModel
from omni_local.model.workarounds import video_supported

IMAGE_SIZES = [(224, 224), (333, 517), (480, 640), (640, 480), (1024, 768), (1216, 1600)]  # (height, width)
CLIP_SECONDS = [1.0, 3.0, 7.5, 10.0, 30.0]


def timed_ms(call, runs: int) -> float:
    return statistics.median(elapsed_s(call) * 1e3 for _ in range(runs))


def encoder_rows(loaded: LoadedModel, runs: int) -> list[dict]:
    processor, device = loaded.processor, loaded.device
    rng = np.random.default_rng(0)
    inputs = {}
    for height, width in IMAGE_SIZES:
        image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        pixels = image_inputs([image], processor)
        inputs[f"image {height}x{width}"] = ("images", pixels["pixel_values"].to(device),
                                             pixels["image_grid_thw"].to(device))
    for seconds in CLIP_SECONDS:
        samples = (rng.standard_normal(int(16_000 * seconds)) * 0.1).astype(np.float32)
        features = audio_inputs([samples], processor)
        inputs[f"clip {seconds:g} s"] = ("audio", features["input_features"].to(device, loaded.dtype),
                                         features["feature_attention_mask"].to(device))
    rows = {name: {"input": name} for name in inputs}
    for compiled in (False, True):
        encoders = Encoders(loaded.model.thinker.model, compile=compiled)
        encoders.warm_up(processor)
        label = "compiled" if compiled else "eager"
        for name, (kind, *tensors) in inputs.items():
            call = getattr(encoders, kind)
            with torch.inference_mode():
                call(*tensors)  # a first call per size: a recompile would show here, not in the median
                rows[name][f"{label}_ms"] = timed_ms(lambda: call(*tensors), runs)
    return list(rows.values())


def preprocessing_rows(loaded: LoadedModel, runs: int) -> list[dict]:
    """Milliseconds to make the pixels of the benchmark's largest image and of its 10 s video's frames
    (not its sound track, whose features are made on the CPU either way) and have them on the model's
    device: made on the CPU and copied there (float32), or made there from the uint8 frames, as the
    engine makes them. Each the median of `runs` after one warm-up."""
    height, width = SCENARIO_IMAGE_SIZES[-1]
    media = {f"image {height}x{width}": (image_inputs, [noise_image((height, width))])}
    if video_supported(loaded.processor):  # the video processor needs torchvision
        media["video 10 s, 20 frames of 360x640"] = (video_inputs, [ten_second_video()])
    rows = []
    for name, (make, items) in media.items():
        on_cpu, on_device = (_pixels_on(loaded, make, items, where) for where in (None, loaded.device))
        rows.append({"input": name, "cpu_ms": median_wall_ms(on_cpu, runs),
                     "device_ms": median_wall_ms(on_device, runs)})
    return rows


def _pixels_on(loaded: LoadedModel, make: Callable, items: list, where: torch.device | None) -> Callable[[], object]:
    """A call that preprocesses `items` by `make` on `where` and leaves their pixels on the model's device."""
    def call() -> torch.Tensor:
        inputs = make(items, loaded.processor, where)
        return next(v for k, v in inputs.items() if k.startswith("pixel_values")).to(loaded.device)

    return call


def first_image_after_start_up(loaded: LoadedModel, settings) -> dict[str, float]:
    start = time.perf_counter()
    with OmniLocal(settings.replace(encoder_cache=False, prefix_cache=False), loaded=loaded) as app:
        up_s = time.perf_counter() - start
        image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (480, 640, 3), dtype=np.uint8))
        final = app.session().send("What is in this picture?", images=[image], max_new_tokens=1).result()
    return {"start_up_s": up_s, "first_image_ttft_ms": final.timings.ttft_s * 1e3}


def main() -> None:
    parser = bench_parser("python -m omni_local.bench.encoders")
    parser.add_argument("--start-up-only", action="store_true", help="only the first image after start-up")
    parser.add_argument("--preprocessing-only", action="store_true", help="only the preprocessing rows")
    args = parser.parse_args()
    settings, loaded = settings_and_model(args)
    device = torch.cuda.get_device_name(loaded.device) if loaded.device.type == "cuda" else "cpu"
    print(f"model: {args.random_weights or 'demo'}, device: {device}, dtype: {loaded.dtype}, "
          f"torch {torch.__version__}, runs: {args.runs}")
    if not args.preprocessing_only:
        first = first_image_after_start_up(loaded, settings.replace(compile=True))
        rows = [] if args.start_up_only else encoder_rows(loaded, args.runs)
        print(f"start-up with warm-up: {first['start_up_s']:.1f} s; first 480x640 image after it: "
              f"TTFT {first['first_image_ttft_ms']:.1f} ms\n")
        print("| input | eager (ms) | compiled (ms) |\n| --- | --- | --- |")
        for row in rows:
            print(f"| {row['input']} | {row['eager_ms']:.1f} | {row['compiled_ms']:.1f} |")
    if not args.start_up_only:
        print(f"\n| preprocessing | on the CPU, then copied (ms) | on {loaded.device} (ms) |\n| --- | --- | --- |")
        for row in preprocessing_rows(loaded, args.runs):
            print(f"| {row['input']} | {row['cpu_ms']:.1f} | {row['device_ms']:.1f} |")


if __name__ == "__main__":
    main()
