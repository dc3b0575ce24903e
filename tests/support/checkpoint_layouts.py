"""The demo checkpoint rewritten in the other file layouts a Qwen3-Omni checkpoint comes in.

The demo is written as transformers 5 saves: one `model.safetensors`, `tokenizer.json`,
`processor_config.json` and `chat_template.jinja`. Qwen's own Qwen3-Omni-30B-A3B-Instruct is in the
older layout: 15 weight shards named in `model.safetensors.index.json`, the vocabulary as
`vocab.json` and `merges.txt` (no `tokenizer.json`), image and audio settings merged in one
`preprocessor_config.json` (no video section: transformers infers the video processor from the image
processor's type), and the template in `chat_template.json`. Copies saved where torchvision was
missing have a placeholder video processor, or none. Every writer here is deterministic.
"""

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file
from transformers.video_processing_utils import VideoProcessorMixin

from omni_local.model.workarounds import ProcessorWithoutVideo

OFFICIAL_SHARDS = 15
_WEIGHTS = "model.safetensors"
_INDEX = "model.safetensors.index.json"


def write_older_layout(demo: Path, target: Path, shards: int = OFFICIAL_SHARDS) -> Path:
    """The demo's model in Qwen's published layout, its weights in `shards` files."""
    target.mkdir(parents=True)
    for name in ("config.json", "generation_config.json"):
        shutil.copy(demo / name, target / name)
    _write_shards(demo / _WEIGHTS, target, shards)
    _write_vocabulary_files(demo, target)
    processor = json.loads((demo / "processor_config.json").read_text(encoding="utf-8"))
    merged = {**processor["feature_extractor"], **processor["image_processor"],
              "processor_class": processor["processor_class"]}
    _write_json(target / "preprocessor_config.json", merged)
    template = (demo / "chat_template.jinja").read_text(encoding="utf-8")
    _write_json(target / "chat_template.json", {"chat_template": template})
    return target


def write_with_video_processor(demo: Path, target: Path, stand_in: VideoProcessorMixin | None) -> Path:
    """A copy of the demo whose processor transformers saved with `stand_in` as its video processor,
    as where torchvision was missing; None: a processor_config.json that records none (transformers
    refuses to save a processor without one)."""
    shutil.copytree(demo, target)
    if stand_in is None:
        config = json.loads((target / "processor_config.json").read_text(encoding="utf-8"))
        del config["video_processor"]
        _write_json(target / "processor_config.json", config)
        return target
    processor = ProcessorWithoutVideo.from_pretrained(demo)  # takes a video processor of any class
    processor.video_processor = stand_in
    processor.save_pretrained(target)
    return target


def _write_shards(weights_file: Path, target: Path, shards: int) -> None:
    weights = load_file(weights_file)
    names = sorted(weights)
    per_shard = -(-len(names) // shards)  # ceiling: every shard but maybe the last equally full
    weight_map = {}
    for number in range(shards):
        shard = f"model-{number + 1:05d}-of-{shards:05d}.safetensors"
        chosen = names[number * per_shard : (number + 1) * per_shard]
        save_file({name: weights[name] for name in chosen}, target / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chosen, shard))
    total_size = sum(t.numel() * t.element_size() for t in weights.values())
    _write_json(target / _INDEX, {"metadata": {"total_size": total_size}, "weight_map": weight_map})


def _write_vocabulary_files(demo: Path, target: Path) -> None:
    """tokenizer.json split as transformers 4 saved a Qwen2 tokenizer: the BPE's vocabulary and merges,
    the added tokens in tokenizer_config.json."""
    tokenizer = json.loads((demo / "tokenizer.json").read_text(encoding="utf-8"))
    _write_json(target / "vocab.json", tokenizer["model"]["vocab"])
    merges = [" ".join(pair) if isinstance(pair, list) else pair for pair in tokenizer["model"]["merges"]]
    (target / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    config = json.loads((demo / "tokenizer_config.json").read_text(encoding="utf-8"))
    config.pop("backend")  # transformers 5's note that tokenizer.json holds the tokenizer
    fields = ("content", "lstrip", "normalized", "rstrip", "single_word", "special")
    config["added_tokens_decoder"] = {
        str(token["id"]): {field: token[field] for field in fields} for token in tokenizer["added_tokens"]
    }
    _write_json(target / "tokenizer_config.json", config)


def _write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
