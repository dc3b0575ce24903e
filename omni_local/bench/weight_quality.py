"""How far each quantized `weights` format moves the Thinker from bf16 (the weights as loaded), on a
fixed prompt set; and, with --layers, each quantized layer's output error on real activations.

    python -m omni_local.bench.weight_quality [--layers]                # the demo model
    python -m omni_local.bench.weight_quality --wide-demo [--layers]    # its variant of 256-wide rows
    python -m omni_local.bench.weight_quality --random-weights CONFIG.json --layers-only --device cuda

Tokens: the model is loaded once per format, with the same settings (random weights from the same
seed). On each prompt bf16 writes a greedy reply (media and end-of-turn tokens suppressed, so every
prompt has a reply of --new-tokens); each format then reads the prompt and that reply in one
forward, so all are scored on the same positions: the mean KL(bf16 || format) of the next-token
distributions and how often the two top-1 tokens agree. Each format also writes its own greedy
reply, compared with bf16's: tokens before the first that differs, and the share of equal tokens.
The bf16 row is bf16 run again: the harness's own noise (0 and 1 where runs are deterministic).
On a float32 model (the CPU's default dtype) a yardstick row follows: the same layers' weights only
rounded to bfloat16, as a real checkpoint already holds them.

Layers: one forward of the bf16 model on a prompt of text, an image and a clip. Each of the
Thinker's attention projections and MoE layers' routed experts is quantized there, one at a time,
in the format `quantize_layers` gives it, and run on the inputs the bf16 layer was given:
||out_q - out|| / ||out||, its median and largest over the layers of each kind. Only the bf16 model
is held, so this runs at full size on one GPU. (On the CPU fp8 attention multiplies by its
dequantized weight; on a GPU with FP8 units its inputs are rounded to fp8 too, as the app does.)
In a model narrower than float32 bf16's rows are the floor: each layer against itself in float32.
The Talker's layers, quantized as well, are not measured: a Thinker forward does not run them.

What it shows, and what not: every model this runs here has random weights (the demo, its wide
variant, the full-size config), so the numbers are each format's rounding of random Gaussian
weights (no outliers, unlike trained ones), carried through random networks whose next-token
distributions are far flatter than a trained model's. They rank the formats and catch a broken
one; they are not a real checkpoint's quality, which needs its weights and task accuracy.
"""

import argparse
import copy
import gc
import json
import platform
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

from omni_local.bench.common import bench_model, bench_parser
from omni_local.bench.scenarios import AUDIO_QUESTION, QUESTION, SYSTEM, noise_clip, noise_image
from omni_local.engine.prompt.builder import build_prompt
from omni_local.engine.prompt.encoder_inputs import transformers_inputs
from omni_local.model.demo import WIDE, ensure_demo_checkpoint
from omni_local.model.loader import LoadedModel, media_markup_token_ids, quiet_library_logs, thinker_eos_token_ids
from omni_local.model.quantized import (
    ATTENTION_PROJECTIONS, QuantizedExperts, QuantizedLinear, WeightsSetting, layer_formats, quantized_places,
)
from omni_local.protocol.messages import Message
from omni_local.settings import Settings, settings_from_arguments

FORMATS: tuple[WeightsSetting, ...] = ("bf16", "fp8", "int4")
QUANTIZED = FORMATS[1:]
BFLOAT16_ROUNDED = "bf16, rounded to bfloat16"  # the yardstick row of a float32 model
RANDOM_SEED = 0  # random weights: every format's model is drawn from this seed
ASKS = {
    "text: story": ["Tell me a short story about a cat who learns to sing."],
    "text: weather": ["How is the weather today, and what should I wear outside?"],
    "text: numbers": ["Count from 1 to 10, then tell me what 42 plus 2025 is."],
    "image 224x224": [noise_image((224, 224)), QUESTION],
    "audio 4 s": [noise_clip(4.0), AUDIO_QUESTION],
}
LAYERS_ASK = [noise_image((480, 640)), noise_clip(10.0), "What do you see and hear?"]


@dataclass(frozen=True)
class Reference:
    """bf16's reading of one prompt: the prompt with its greedy reply, and the next-token log-probabilities."""

    inputs: dict  # the prompt's model inputs, on the model's device
    sequence: torch.Tensor  # [1, L + N]: the prompt, then bf16's greedy reply
    prompt_tokens: int  # L
    log_probs: torch.Tensor  # [L + N - 1, V] float32 on the CPU: position i predicts token i + 1


@dataclass(frozen=True)
class Score:
    """One format on one prompt, against its `Reference`."""

    kl: torch.Tensor  # [L + N - 1] KL(bf16 || format) in nats
    top1_equal: torch.Tensor  # [L + N - 1] bool
    reply_from: int  # the first position that predicts a reply token: L - 1
    greedy_equal: torch.Tensor  # [N] bool: the format's own greedy reply, token by token, against bf16's

    @property
    def first_difference(self) -> int:
        differ = (~self.greedy_equal).nonzero()
        return int(differ[0]) if len(differ) else len(self.greedy_equal)


def messages(ask: list) -> list[Message]:
    return [Message("system", [SYSTEM]), Message("user", list(ask))]


def model_inputs(loaded: LoadedModel, ask: list) -> dict:
    prompt = build_prompt(messages(ask), loaded.processor)
    inputs = transformers_inputs(prompt, loaded.processor, loaded.device)
    return {k: v.to(loaded.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def greedy(loaded: LoadedModel, inputs: dict, new_tokens: int) -> torch.Tensor:
    """[1, L + new_tokens]: the prompt and the greedy reply, never a media or end-of-turn token."""
    suppressed = media_markup_token_ids(loaded) + thinker_eos_token_ids(loaded)
    return loaded.model.thinker.generate(**inputs, max_new_tokens=new_tokens, do_sample=False,
                                         suppress_tokens=suppressed)


def log_probs(loaded: LoadedModel, inputs: dict, sequence: torch.Tensor) -> torch.Tensor:
    """[L + N - 1, V] float32: the next-token log-probabilities of `sequence`, read in one forward."""
    forced = {**inputs, "input_ids": sequence, "attention_mask": torch.ones_like(sequence), "use_cache": False}
    return loaded.model.thinker(**forced).logits[0, :-1].float().log_softmax(-1)


def reference(loaded: LoadedModel, ask: list, new_tokens: int) -> Reference:
    inputs = model_inputs(loaded, ask)
    sequence = greedy(loaded, inputs, new_tokens)
    return Reference(inputs, sequence, inputs["input_ids"].shape[1], log_probs(loaded, inputs, sequence).cpu())


def score(loaded: LoadedModel, ref: Reference) -> Score:
    own = greedy(loaded, ref.inputs, ref.sequence.shape[1] - ref.prompt_tokens)
    ours = log_probs(loaded, ref.inputs, ref.sequence)
    theirs = ref.log_probs.to(ours.device)
    kl = F.kl_div(ours, theirs, log_target=True, reduction="none").sum(-1)
    top1 = ours.argmax(-1) == theirs.argmax(-1)
    equal = own[0, ref.prompt_tokens:] == ref.sequence[0, ref.prompt_tokens:]
    return Score(kl.double().cpu(), top1.cpu(), ref.prompt_tokens - 1, equal.cpu())


def format_row(weights: str, formats: str, scores: list[Score]) -> dict:
    kl = torch.cat([s.kl for s in scores])
    reply_kl = torch.cat([s.kl[s.reply_from:] for s in scores])
    firsts = [s.first_difference for s in scores]
    return {
        "weights": weights, "formats": formats, "positions": len(kl),
        "mean_kl": kl.mean().item(), "reply_mean_kl": reply_kl.mean().item(),
        "top1_agreement": torch.cat([s.top1_equal for s in scores]).float().mean().item(),
        "first_difference_mean": statistics.mean(firsts), "first_difference_min": min(firsts),
        "greedy_equal": torch.cat([s.greedy_equal for s in scores]).float().mean().item(),
    }


def layer_errors(loaded: LoadedModel, ask: list) -> list[dict]:
    """Each quantized format's relative output error per kind of Thinker layer, on the inputs one
    bf16 forward of `ask` gives those layers. In a model of a narrower dtype than float32, bf16's
    own rows too: the layer's output against the same layer run in float32."""
    kinds = (*ATTENTION_PROJECTIONS, "experts")
    own_rounding = loaded.dtype != torch.float32
    errors: dict[tuple[WeightsSetting, str], list[float]] = {
        (weights, kind): [] for weights in (FORMATS if own_rounding else QUANTIZED) for kind in kinds}

    def compare(kind: str):
        def hook(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
            for weights in QUANTIZED:
                dense, experts = layer_formats(weights)
                quantized = (QuantizedExperts.replacing(module, experts) if kind == "experts"
                             else QuantizedLinear.replacing(module, dense))
                errors[weights, kind].append(relative_error(quantized(*args), out))
                del quantized  # one quantized layer at a time
            if own_rounding:
                exact = copy.deepcopy(module).float()
                # `forward`, not a call: the copy carries this hook too.
                in_float32 = exact.forward(*(a.float() if a.is_floating_point() else a for a in args))
                errors["bf16", kind].append(relative_error(out, in_float32))
                del exact
        return hook

    handles = []
    for layer in loaded.model.thinker.model.language_model.layers:
        handles += [getattr(layer.self_attn, name).register_forward_hook(compare(name))
                    for name in ATTENTION_PROJECTIONS]
        if getattr(layer.mlp, "experts", None) is not None:
            handles.append(layer.mlp.experts.register_forward_hook(compare("experts")))
    try:
        loaded.model.thinker(**model_inputs(loaded, ask), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return [{"weights": weights, "layer": kind, "layers": len(values), "median": statistics.median(values),
             "max": max(values), "format": (f"{str(loaded.dtype).removeprefix('torch.')}, against float32"
                                            if weights == "bf16" else layer_formats(weights)[kind == "experts"])}
            for (weights, kind), values in errors.items() if values]


def round_to_bfloat16(model: torch.nn.Module) -> None:
    """The parameters of every layer a format quantizes (int4's, fp8's among them), rounded to
    bfloat16 in place."""
    for parent, name, _ in quantized_places(model, "int4"):
        for weight in getattr(parent, name).parameters():
            weight.copy_(weight.to(torch.bfloat16))


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.float() - expected.float()).norm() / expected.float().norm()).item()


def fingerprint(loaded: LoadedModel) -> float:
    """A sum of weights no format quantizes (the Thinker's routers): equal for models built from the
    same weights."""
    layers = loaded.model.thinker.model.language_model.layers
    return sum(layer.mlp.gate.weight.double().sum().item() for layer in layers if hasattr(layer.mlp, "gate"))


def measure(settings: Settings, random_weights: Path | None, new_tokens: int, layers: bool, tokens: bool) -> dict:
    """Every format's row and each prompt's scores (`tokens`), and the layer errors (`layers`)."""
    result: dict = {"formats": [], "prompts": {}, "layers": []}
    refs: dict[str, Reference] = {}
    for weights in FORMATS if tokens else FORMATS[:1]:
        torch.manual_seed(RANDOM_SEED)
        loaded = bench_model(settings.replace(weights=weights), random_weights)
        if weights == "bf16":
            result["setup"] = setup(loaded, random_weights)
            if layers:
                result["layers"] = layer_errors(loaded, LAYERS_ASK)
            if tokens:
                refs = {name: reference(loaded, ask, new_tokens) for name, ask in ASKS.items()}
        elif fingerprint(loaded) != result["setup"]["fingerprint"]:
            raise RuntimeError(f"the {weights} model was not built from the bf16 model's weights")
        if tokens:
            add_row(result, weights, "-" if weights == "bf16" else " / ".join(layer_formats(weights)), loaded, refs)
        if tokens and weights == "bf16" and loaded.dtype == torch.float32:
            round_to_bfloat16(loaded.model)
            add_row(result, BFLOAT16_ROUNDED, "bfloat16 / bfloat16", loaded, refs)
        del loaded
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return result


def add_row(result: dict, weights: str, formats: str, loaded: LoadedModel, refs: dict[str, Reference]) -> None:
    scores = {name: score(loaded, ref) for name, ref in refs.items()}
    result["formats"].append(format_row(weights, formats, list(scores.values())))
    for name, s in scores.items():
        result["prompts"].setdefault(name, {"tokens": refs[name].sequence.shape[1]})[weights] = {
            "mean_kl": s.kl.mean().item(), "top1_agreement": s.top1_equal.float().mean().item(),
            "first_difference": s.first_difference}


def setup(loaded: LoadedModel, random_weights: Path | None) -> dict:
    model = f"random weights of {random_weights}" if random_weights else str(loaded.path)
    if loaded.device.type == "cuda":
        device = torch.cuda.get_device_name(loaded.device)
    else:
        device = f"{cpu_name()}, {torch.get_num_threads()} threads"
    return {"model": model, "device": f"{loaded.device} ({device})",
            "dtype": str(loaded.dtype).removeprefix("torch."), "torch": torch.__version__,
            "transformers": transformers.__version__, "fingerprint": fingerprint(loaded)}


def cpu_name() -> str:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine()
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")]
    return names[0] if names else platform.machine()


def tables(result: dict, new_tokens: int) -> str:
    s = result["setup"]
    lines = [f"{s['model']}; {s['device']}, {s['dtype']}; torch {s['torch']}, transformers {s['transformers']}"]
    if result["formats"]:
        lines += ["", _row("weights", "attention / experts", "positions", "mean KL(bf16 ‖ format), nats",
                           "mean KL, reply positions", "top-1 agreement",
                           f"greedy reply of {new_tokens}: tokens before the first difference, mean (min)",
                           "greedy reply: tokens equal"), "|---" * 8 + "|"]
        lines += [_row(r["weights"], r["formats"], r["positions"], f"{r['mean_kl']:.3g}", f"{r['reply_mean_kl']:.3g}",
                       f"{r['top1_agreement']:.3f}", f"{r['first_difference_mean']:.1f} ({r['first_difference_min']})",
                       f"{r['greedy_equal']:.3f}") for r in result["formats"]]
        lines += ["", _row("prompt", "tokens (prompt + reply)",
                           *(f"{w} {column}" for w in QUANTIZED for column in ("KL", "top-1", "first difference"))),
                  "|---" * (2 + 3 * len(QUANTIZED)) + "|"]
        for name, scores in result["prompts"].items():
            lines.append(_row(name, scores["tokens"], *(cell for w in QUANTIZED for cell in (
                f"{scores[w]['mean_kl']:.3g}", f"{scores[w]['top1_agreement']:.3f}", scores[w]["first_difference"]))))
    if result["layers"]:
        head = _row("weights", "layer", "format", "layers", "median ‖out_q − out‖ / ‖out‖", "max")
        lines += ["", head, "|---" * 6 + "|"]
        lines += [_row(r["weights"], r["layer"], r["format"], r["layers"], f"{r['median']:.4f}", f"{r['max']:.4f}")
                  for r in result["layers"]]
    return "\n".join(lines)


def _row(*cells: object) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def bench_settings(args: argparse.Namespace) -> Settings:
    """The settings of `args`, with --wide-demo the wide demo's checkpoint (written beside the demo)."""
    quiet_library_logs()
    settings = settings_from_arguments(args)
    if args.wide_demo:
        settings = settings.replace(model=str(ensure_demo_checkpoint(settings.demo_path.parent / "demo-wide", WIDE)))
    return settings


def main() -> None:
    parser = bench_parser("python -m omni_local.bench.weight_quality", timed=False)
    parser.add_argument("--wide-demo", action="store_true",
                        help="the demo at rows of 256 inputs (int4 groups of 128), written beside the demo")
    parser.add_argument("--new-tokens", type=int, default=32, help="bf16's greedy reply, scored on every prompt")
    parser.add_argument("--layers", action="store_true", help="also each quantized layer's output error")
    parser.add_argument("--layers-only", action="store_true", help="only the layers' errors (loads bf16 alone)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    settings = bench_settings(args)
    with torch.inference_mode():
        result = measure(settings, args.random_weights, args.new_tokens, layers=args.layers or args.layers_only,
                         tokens=not args.layers_only)
    print(tables(result, args.new_tokens))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
