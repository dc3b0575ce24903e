"""Which card runs what: the model in a `weights` format, the process capped at a card's memory, one
app serving a spoken reply and a question on a 480x640 image with 10 s of audio.

    python -m omni_local.bench.card_sizes --random-weights CONFIG.json --weights int4 --speech true --card-gib 24
    python -m omni_local.bench.card_sizes ... --card-gib 24 --plan     # the KV as the memory plan sizes it
    python -m omni_local.bench.card_sizes ... --card-gib 14.5 --plan   # and the experts it puts in host memory

The weights are loaded first (random ones are built in full precision and quantized on the device,
so the cap comes after them: it bounds what serving takes, the weights included); then the process
is capped at --card-gib with `torch.cuda.set_per_process_memory_fraction`, the app starts (KV, CUDA
graphs) and each request is sent --runs times after a warm-up, a new question each time. Prints one
table row (medians; times are the engine's own), or where the app did not fit, what ran out. The
start-up's steps go to stderr, each with the GPU memory it kept: which part of the engine's take is which.

Experts in host memory (model/host_experts.py: `--experts-on-gpu N`, or where --plan moves them), and
the input embeddings where --plan moves them, are not in the weights' GiB (the GPU's) nor under the
cap: the row says how many layers' experts are there, the bytes a decoded token reads over the bus,
and the tokens a second that bound allows on PCIe 4.0 x16 (about 25 GB/s), beside the decode step
measured on this machine's bus.

After the row, two lines say what the plan's margin (MARGIN_BYTES) has to hold: with
--largest-request, what a request of the most image tokens one prompt holds (the processor's largest
image, as many as `max_prompt_tokens` allows) allocated beyond what was allocated before it (its
pixels, the encoders' activations, its prefill); and the memory CUDA took outside torch's allocator
since the cap (kernel modules, graph executables, library handles), with the allocator's reserved
memory. A per-process cap does not count the outside memory, a real card does: --outside-mib leaves
it out of the cap. --margin-mib tries the plan with another margin.
"""

import math
import statistics
import sys
from typing import Any

import torch

from omni_local.api import OmniLocal
from omni_local.bench.common import bench_parser, settings_and_model, synced_now
from omni_local.bench.decode_steps import step_ms
from omni_local.bench.scenarios import SPOKEN_QUESTION, SYSTEM, noise_clip, noise_image
from omni_local.engine.prompt.builder import image_grid
from omni_local.engine.sizing.expert_placement import BUS_BYTES_PER_S, bus_bytes_per_token
from omni_local.engine.sizing.memory_plan import MARGIN_BYTES, GiB, plan_memory
from omni_local.errors import RequestError, SettingsError
from omni_local.model.host_experts import (embeddings_in_host_memory, held_in_host_memory, layers_in_host_memory,
                                           move_to_host_memory, thinker_experts)
from omni_local.model.loader import LoadedModel
from omni_local.protocol.messages import Message
from omni_local.settings import Settings
from omni_local.start_up_steps import show_start_up_steps

ASKED = Message("user", [noise_image((480, 640)), noise_clip(10.0), "What do you see and hear?"])
HEAD = ("| weights | speech | card GiB | weights GiB | experts in host memory | bus MB a token | tokens/s on PCIe 4.0 "
        "x16 at most | allocated after start-up GiB | peak allocated GiB | start-up s | image + audio TTFT ms "
        "| first audio ms | RTF | decode step ms (1 chat, 256 rows) |")


def gib(count: int) -> str:
    return f"{count / 2**30:.2f}"


def held_bytes(model: torch.nn.Module) -> int:
    """The GPU's bytes of the model's parameters and buffers (quantized ones at their stored size; not
    the experts in host memory)."""
    held = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    return held - held_in_host_memory(model)


def host_cells(model: torch.nn.Module, weights: str) -> list[str]:
    """The weights in host memory (experts' layers, the input embeddings, GiB), the bytes a decoded
    token reads of them, and the tokens a second that allows at BUS_BYTES_PER_S."""
    layers, embeddings = layers_in_host_memory(model), embeddings_in_host_memory(model)
    if not layers and not embeddings:
        return ["none", "0", "-"]
    bus = bus_bytes_per_token(model, weights, layers, embeddings)
    held = [*([f"{len(layers)} of {len(thinker_experts(model))} layers"] if layers else []),
            *(["the input embeddings"] if embeddings else [])]
    return [f"{' and '.join(held)}, {gib(held_in_host_memory(model))} GiB", f"{bus / 1e6:.3g}",
            f"{BUS_BYTES_PER_S / bus:.0f}"]


def cap(card_gib: float | None, outside: int = 0) -> None:
    """What the process's allocator may reserve from here on: `card_gib` less `outside` (the memory
    CUDA will take outside the allocator, which the cap does not count), as on a card of that size."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    if card_gib:
        allowed = card_gib * 2**30 - outside
        torch.cuda.set_per_process_memory_fraction(allowed / torch.cuda.get_device_properties(0).total_memory)


def served(app: OmniLocal, runs: int, new_tokens: int) -> list[str]:
    """The image-and-audio TTFT, first audio, RTF and decode step: median cells of the row."""
    asked, spoken = [], []
    for run in range(runs + 1):
        session = app.session(system_prompt=SYSTEM)
        text = Message("user", [*ASKED.parts[:-1], f"Take {run}: {ASKED.parts[-1]}"])
        asked.append(session.send(text.text, images=text.images(), audio=text.audios(),
                                  max_new_tokens=new_tokens).result())
        if app.backend.engine.speaker:
            spoken.append(app.session(system_prompt=SYSTEM).send(
                f"Take {run}: {SPOKEN_QUESTION}", speak=True, max_new_tokens=new_tokens).result())
    ttft = statistics.median(f.timings.ttft_s * 1e3 for f in asked[1:])
    speech = [f.speech for f in spoken[1:]]
    first_audio = f"{statistics.median(s.first_audio_s * 1e3 for s in speech):.1f}" if speech else "-"
    rtf = f"{statistics.median(s.real_time_factor for s in speech):.3f}" if speech else "-"
    decode = step_ms(app.backend.engine.runner, 1, 256, runs)
    return [f"{ttft:.1f}", first_audio, rtf, f"{decode:.2f}"]


def outside_allocator() -> int:
    """The GPU memory this process holds outside torch's caching allocator (and whatever other
    processes hold): the device's used memory less what the allocator reserved."""
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()


def largest_request(processor: Any, max_prompt_tokens: int) -> tuple[Message, int]:
    """A question on as many of the processor's largest images as `max_prompt_tokens` holds (with
    room for the system prompt and the question), and their image tokens."""
    processor = processor.image_processor
    side = int(processor.size["longest_edge"] ** 0.5)
    tokens = math.prod(image_grid(noise_image((side, side)), processor)) // processor.merge_size ** 2
    count = max(1, (max_prompt_tokens - 256) // tokens)
    # A seed each: the same image twice would be encoded once.
    images = [noise_image((side, side), seed=i) for i in range(count)]
    return Message("user", [*images, "What do these pictures show?"]), count * tokens


def largest_line(app: OmniLocal, loaded: LoadedModel, settings: Settings) -> str:
    """The GPU memory a request of the most image tokens a prompt holds allocated beyond what was
    allocated before it: what the plan's margin keeps room for."""
    asked, tokens = largest_request(loaded.processor, settings.max_prompt_tokens)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    try:
        app.session(system_prompt=SYSTEM).send(asked.text, images=asked.images(), max_new_tokens=1).result()
    except (torch.OutOfMemoryError, RequestError) as error:
        return f"largest request ({len(asked.images())} images, {tokens:,} image tokens): did not fit: {error}"
    took = torch.cuda.max_memory_allocated() - before
    return (f"largest request ({len(asked.images())} images, {tokens:,} image tokens): {took / 2**20:,.0f} MiB "
            f"allocated beyond the {gib(before)} GiB before it")


def row(settings: Settings, card_gib: float | None, model: torch.nn.Module, cells: list[str]) -> str:
    card = f"{card_gib:g}" if card_gib else "-"
    head = [settings.weights, "on" if settings.speech else "off", card, gib(held_bytes(model)),
            *host_cells(model, settings.weights)]
    return "| " + " | ".join(head + cells) + " |"


def planned(settings: Settings, loaded: LoadedModel, card_gib: float, margin: int = MARGIN_BYTES) -> Settings:
    """`settings` with the caches (KV, encoder outputs) the memory plan sizes on a card of `card_gib`
    less `margin` (the plan's, by default), and the experts it puts in host memory moved there; exits
    with the plan's refusal as the row where it refuses."""
    card = settings.replace(gpu_memory_bytes=int(card_gib * GiB) - margin)
    try:
        plan = plan_memory(loaded.model, card, loaded.device)
    except SettingsError as refusal:
        print(row(settings, card_gib, loaded.model, [f"refused by the memory plan: {refusal}"]))
        sys.exit(1)
    print(plan.line(), file=sys.stderr)
    move_to_host_memory(loaded.model, plan.experts_on_gpu, plan.host_embeddings > 0)
    if loaded.device.type == "cuda":
        torch.cuda.empty_cache()  # the moved weights' GPU copies, given back
        # The row's peak is serving's: not the moved weights' copies, built on the GPU before the plan
        # moved them (a checkpoint's load puts them in host memory at once).
        torch.cuda.reset_peak_memory_stats()
    return plan.applied(settings)


def main() -> None:
    parser = bench_parser("python -m omni_local.bench.card_sizes")
    parser.add_argument("--card-gib", type=float, help="cap the process's GPU memory here once the weights are in")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--plan", action="store_true",
                        help="size the KV as the start-up's memory plan would on a card of --card-gib (less the "
                             "plan's margin), and print the plan; one that refuses is the row")
    parser.add_argument("--margin-mib", type=int, default=MARGIN_BYTES >> 20,
                        help="with --plan: the card's memory the plan leaves out (to try another margin)")
    parser.add_argument("--outside-mib", type=int, default=0,
                        help="leave this much of the card out of the cap: what CUDA takes outside torch's allocator")
    parser.add_argument("--largest-request", action="store_true",
                        help="then send the most image tokens a prompt holds, and say what that allocated")
    args = parser.parse_args()
    show_start_up_steps()
    settings, loaded = settings_and_model(args)
    on_gpu = loaded.device.type == "cuda"
    if on_gpu:
        cap(args.card_gib, args.outside_mib << 20)
    print(HEAD + "\n|" + " --- |" * HEAD.count(" | ") + " --- |", flush=True)
    outside_at_cap = outside_allocator() if on_gpu else 0
    if args.plan:
        settings = planned(settings, loaded, args.card_gib, args.margin_mib << 20)
    try:
        start = synced_now()
        with OmniLocal(settings, loaded=loaded) as app:
            start_up_s = synced_now() - start
            started = torch.cuda.memory_allocated() if on_gpu else 0
            cells = served(app, args.runs, args.new_tokens)
            peak = torch.cuda.max_memory_allocated() if on_gpu else 0
            print(row(settings, args.card_gib, loaded.model, [gib(started), gib(peak), f"{start_up_s:.1f}", *cells]))
            if on_gpu and args.largest_request:
                print(largest_line(app, loaded, settings))
    except torch.OutOfMemoryError as error:
        print(row(settings, args.card_gib, loaded.model, ["did not fit: " + str(error).splitlines()[0]]))
        sys.exit(1)
    if on_gpu:
        print(f"outside torch's allocator: {(outside_allocator() - outside_at_cap) / 2**20:,.0f} MiB more than "
              f"at the cap; the allocator's peak reserved {gib(torch.cuda.max_memory_reserved())} GiB, now "
              f"{gib(torch.cuda.memory_reserved())} GiB reserved of which {gib(torch.cuda.memory_allocated())} allocated")


if __name__ == "__main__":
    main()
