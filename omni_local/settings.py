"""One typed, read-only settings object: `settings.toml`, then command-line overrides.

The settings come in groups, one per TOML table, by who reads them: [model] (the loader), [engine],
[speech] and [cache] (the engine), [ui] (the page), [server] (the API server), [backend] (which
backend answers) and [limits] (what a user may send). `Settings` is all of them at once, read flat
(`settings.max_new_tokens`); `EngineConfig` is the four the engine reads, which is all the local
backend hands it. Every key name is unique across tables, so the command line can override any of
them by name (`--max-new-tokens 64`). Validation happens once, here, each group checking its own
values: an unknown key or a value of the wrong type is a `SettingsError` naming the key and what
was expected. Each field's help is written once, here: the command line's --help shows it, and
settings.toml and docs/settings.md are written from it (`python -m omni_local.settings_files`).
"""

import argparse
import dataclasses
import tomllib
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, Self, get_args, get_origin

from omni_local.errors import SettingsError

# How a remote server streams spoken replies (backends/remote/): "auto" tells from the stream.
BackendDialect = Literal["auto", "openai", "vllm-omni"]
DEFAULT_SETTINGS_FILE = Path(__file__).resolve().parent.parent / "settings.toml"


def setting(default: Any, help: str) -> Any:
    """A settings field: its default and its one-line help (its group gives its TOML table)."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class _Group:
    """What every group of settings does: check its values once, and `replace` refusing unknown keys."""

    def __init_subclass__(cls, table: str = "", **kwargs: Any) -> None:
        # Runs as the class is made, before @dataclass reads its fields: each field the group declares
        # is stamped with the group's table, which it keeps in the groups that combine it.
        super().__init_subclass__(**kwargs)
        for declared in vars(cls).values():
            if isinstance(declared, Field):
                declared.metadata = MappingProxyType({**declared.metadata, "table": table})

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_type(f.name, getattr(self, f.name), f.type)
        # Each class's own checks, the groups' before those of what combines them.
        for cls in reversed(type(self).__mro__):
            if "_check" in vars(cls):
                vars(cls)["_check"](self)

    def replace(self, **changes: Any) -> Self:
        unknown = sorted(set(changes) - {f.name for f in fields(self)})
        if unknown:
            raise SettingsError(f"unknown setting '{unknown[0]}'")
        return dataclasses.replace(self, **changes)


def _positive(group: _Group, *names: str) -> None:
    for name in names:
        if getattr(group, name) <= 0:
            raise SettingsError(f"setting '{name}' must be positive, got {getattr(group, name)!r}")


def _at_least_zero(group: _Group, *names: str) -> None:
    for name in names:
        if getattr(group, name) < 0:
            raise SettingsError(f"setting '{name}' must be 0 or more, got {getattr(group, name)!r}")


def _port(group: _Group, name: str) -> None:
    if getattr(group, name) > 65535:
        raise SettingsError(f"setting '{name}' must be a port number, 1 to 65535, got {getattr(group, name)}")


@dataclass(frozen=True)
class ModelSettings(_Group, table="model"):
    """What the model loader reads: which checkpoint, where it runs, and how its weights are held."""

    model: str = setting("demo", "a checkpoint folder, or 'demo': a tiny built-in model with random weights")
    device: str = setting("auto", "'auto' (the GPU if there is one), 'cpu', 'cuda' or 'cuda:N'")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = setting(
        "auto", "the weights' and activations' dtype; 'auto' is bfloat16 on a GPU, float32 on the CPU"
    )
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = setting(
        "sdpa",
        "which attention transformers' own modules run (the encoders, and the Thinker's forwards that use"
        " transformers' attention); 'flash_attention_2' needs flash-attn installed",
    )
    speech: bool = setting(False, "load the Talker and Code2Wav, for spoken replies; off saves their memory")
    weights: Literal["bf16", "fp8", "int4"] = setting(
        "bf16",
        "how the Thinker's and Talker's routed experts and attention projections are held: 'bf16' as the checkpoint"
        " has them (in dtype; a checkpoint quantized with compressed-tensors, W4A16 or FP8, as it was quantized),"
        " 'fp8' (float8 with a scale per output row; GPUs of compute capability 8.9 or newer), 'int4' (experts in 4"
        " bits with a scale per 128 inputs, attention projections in int8; any GPU our kernels run on): fewer bytes,"
        " so a smaller card and faster decode, at some quality; a bf16 checkpoint is quantized as it loads, and the"
        " result kept in cache_dir for the next start",
    )
    experts_on_gpu: int = setting(
        -1,
        "how many of the Thinker's first layers keep their routed experts on the GPU; the rest keep them in"
        " page-locked host memory, and each decoded token reads its routed experts of those layers over the bus"
        " (about 19 MB a layer in int4: a card of 16 GB runs, slower); -1: the GPU memory plan decides (all on the"
        " GPU where they fit, else the fewest last layers in host memory that make it fit, up to half the machine's"
        " memory); on the CPU, nothing to move",
    )
    model_kind: Literal["auto", "instruct", "thinking", "captioner"] = setting(
        "auto",
        "which Qwen3-Omni checkpoint it is; 'auto': one with a Talker is Instruct, one whose chat template opens a"
        " reasoning block is Thinking, one whose folder is named for the Captioner is the Captioner, another is"
        " Instruct without speech",
    )
    demo_dir: str = setting("", "where the demo model is written; '' is <cache_dir>/demo")

    def _check(self) -> None:
        if self.experts_on_gpu < -1:
            raise SettingsError("setting 'experts_on_gpu' must be -1 (the memory plan decides) or a number of layers, "
                                f"got {self.experts_on_gpu!r}")


@dataclass(frozen=True)
class EngineSettings(_Group, table="engine"):
    """How the engine computes: context, batching, prefill chunks, kernels, media rates and a reply's defaults."""

    max_context_tokens: int = setting(8192, "prompt plus reply, per request")
    max_running_requests: int = setting(
        16,
        "requests computed at once: a decode step's largest batch (its CUDA graphs are captured up to it); more wait"
        " their turn",
    )
    compile: bool = setting(
        False,
        "compile the vision and audio encoders at start-up, so one graph serves every image size and clip length;"
        " it adds start-up time and gains nothing on the CPU",
    )
    cuda_graphs: bool = setting(
        True,
        "on a GPU, run the Thinker's decode steps (chats decoding at once as one batch) and prefills of up to"
        " prefill_forward_tokens, the Talker's and its code predictor's steps, and Code2Wav's chunks, as CUDA graphs"
        " captured at start-up (the app serves once the decode steps' graphs are captured, and captures the prefills'"
        " while idle); false: eager",
    )
    prefill_chunk_tokens: int = setting(
        512,
        "while another reply is decoding or speaking, a prompt is computed in chunks of this many tokens, one per"
        " engine turn, each ending at a multiple of it, so that reply waits one chunk at a time, not for a whole long"
        " prompt (else in forwards of up to prefill_forward_tokens); smaller chunks make those waits shorter and a"
        " long prompt's first token later, as each chunk reads the experts' weights again; short prompts waiting"
        " together are computed in one turn while their tokens stay within it",
    )
    prefill_forward_tokens: int = setting(
        4096,
        "with no other reply to wait, a prompt is computed in one forward of up to this many tokens (a longer one in"
        " forwards ending at multiples of it, so boundaries stay fixed by position; a multiple of"
        " prefill_chunk_tokens); on a GPU each forward replays a CUDA graph captured at start-up for its length"
        " rounded up (16, 32, ... to prefill_chunk_tokens, then four steps to each doubling: 640, 768, 896, 1024,"
        " 1280, ...): more takes more start-up time and GPU memory for the graphs; where the GPU memory plan falls"
        " short of its KV target, it halves this (down to prefill_chunk_tokens) before moving any expert",
    )
    chunk_every_prefill: bool = setting(
        False,
        "compute every prompt in chunks, even with no other reply to wait: slower alone, but each prompt is cut at"
        " the same rows whatever else runs",
    )
    compiled_layers: bool = setting(
        True,
        "on a GPU, run the work around attention in each decoder layer (norms, projections, rotary embedding, MoE"
        " routing and experts) as compiled regions, inside the CUDA graphs and in eager forwards: faster decode"
        " steps; compiling adds start-up time, least when inductor's cache has them",
    )
    moe_backend: Literal["auto", "torch", "triton"] = setting(
        "auto",
        "what runs the MoE layers' routed experts (Thinker and Talker): 'triton' (our kernels: fused routing, tokens"
        " sorted by expert, two grouped GEMMs), 'torch' (transformers' own modules), or 'auto' (triton on a CUDA GPU"
        " of compute capability 8.0 or newer, torch elsewhere); 'triton' where Triton cannot run is refused, saying"
        " why",
    )
    attention_backend: Literal["auto", "torch", "triton"] = setting(
        "auto",
        "what decode steps (the Thinker's and the Talker's) and graphed prefills on a cached prefix attend with:"
        " 'triton' (our kernel, reading each chat's KV blocks in place), 'torch' (transformers' attention over the"
        " rows gathered from the blocks), or 'auto' (triton on a CUDA GPU, torch elsewhere); a chat's first prefill,"
        " and an eager one, use transformers' attention over its own rows, unless deterministic",
    )
    deterministic: bool = setting(
        False,
        "a greedy reply never depends on the prefix cache, on the other chats decoding beside it or on how its prompt"
        " was split between cache and compute: every kernel on the Thinker's and the Talker's path computes a"
        " token's row alone (\"Deterministic mode\" in docs/architecture.md); slower decode steps and prefills, and"
        " it needs our Triton kernels (a CUDA GPU), so moe_backend and attention_backend may not be 'torch'",
    )
    video_fps: float = setting(
        2.0,
        "video frames read per second (Qwen's default; the checkpoint's video processor's own rate if it sets one),"
        " at least 4 and at most 768 frames a clip",
    )
    use_audio_in_video: bool = setting(
        True,
        "the model also hears a video's sound track, interleaved with its frames by time (a silent clip gets silence)",
    )
    max_new_tokens: int = setting(512, "a reply's default length limit, in tokens")
    max_reasoning_tokens: int = setting(
        0,
        "default; a Thinking checkpoint's reasoning ends after this many tokens and its answer begins; 0: only"
        " max_new_tokens limits it",
    )
    temperature: float = setting(0.0, "a reply's default sampling temperature; 0 is greedy")
    top_p: float = setting(1.0, "a reply's default nucleus sampling mass; 1 keeps every token")
    top_k: int = setting(0, "a reply's default top-k; 0 keeps every token")
    repetition_penalty: float = setting(1.0, "a reply's default repetition penalty; 1 is off")

    def _check(self) -> None:
        _positive(self, "max_context_tokens", "max_running_requests", "prefill_chunk_tokens", "prefill_forward_tokens",
                  "video_fps", "max_new_tokens")
        _at_least_zero(self, "max_reasoning_tokens")
        if self.prefill_forward_tokens % self.prefill_chunk_tokens:
            raise SettingsError(f"setting 'prefill_forward_tokens' ({self.prefill_forward_tokens}) must be a "
                                f"multiple of 'prefill_chunk_tokens' ({self.prefill_chunk_tokens})")
        for backend in ("moe_backend", "attention_backend"):
            if self.deterministic and getattr(self, backend) == "torch":
                raise SettingsError(f"setting 'deterministic' runs our Triton kernels, and '{backend}' is 'torch': "
                                    "set it to 'auto' or 'triton', or deterministic = false")


@dataclass(frozen=True)
class SpeechSettings(_Group, table="speech"):
    """How spoken replies are cut into audio chunks, and how long one may be."""

    voice: str = setting("Ethan", "default voice of spoken replies (one of the checkpoint's speakers)")
    first_audio_frames: int = setting(
        2, "codec frames (80 ms of audio each) in a spoken reply's first audio chunk: few, for an early first"
        " sound"
    )
    audio_chunk_frames: int = setting(
        10,
        "most codec frames in an audio chunk: chunks double from first_audio_frames up to this, so each is ready"
        " before the one playing ends; larger chunks cost Code2Wav less per frame",
    )
    audio_left_context_frames: int = setting(
        25,
        "earlier frames Code2Wav sees before each chunk (Qwen's own choice); more is closer to one decode of the"
        " whole reply, and slower",
    )
    max_speech_seconds: float = setting(120.0, "longest spoken reply")

    def _check(self) -> None:
        _positive(self, "first_audio_frames", "audio_chunk_frames", "audio_left_context_frames", "max_speech_seconds")


@dataclass(frozen=True)
class CacheSettings(_Group, table="cache"):
    """Where the app keeps data, and how much memory and disk its caches (KV, encoder outputs) take."""

    cache_dir: str = setting(
        "~/.cache/omni_local",
        "private folder for the app's data: the demo model, saved chats and uploads, encoder outputs, quantized"
        " weights, compiled kernels, the measured memory plan",
    )
    prefix_cache: bool = setting(
        True,
        "keep each chat's KV for its next turn and for chats that start the same way, so they compute only what is"
        " new; false keeps nothing",
    )
    gpu_memory_bytes: int = setting(
        0,
        "GPU memory the app plans with at start-up: the weights, the engine's graphs and activations, encoder"
        " outputs, then KV up to gpu_cache_bytes; 0: what the GPU reports free, less a 768 MiB margin (on the CPU,"
        " no plan unless it is set)",
    )
    gpu_cache_bytes: int = setting(
        4 << 30,
        "most device memory for the Thinker's KV (less where the memory plan leaves less; on the CPU, where the host"
        " memory plan does), allocated at start-up as blocks every chat draws from: it decides how many tokens of"
        " chats stay on the device (Qwen3-Omni in bfloat16 takes 96 KiB a token)",
    )
    kv_block_tokens: int = setting(
        16,
        "tokens per KV block, a power of two up to 256: the unit chats share of a common prefix, and the least a chat"
        " holds",
    )
    kv_dtype: Literal["auto", "fp8"] = setting(
        "auto",
        "how the KV is stored, the Thinker's and the Talker's: 'auto' (in the model's dtype) or 'fp8' (float8 e4m3"
        " with a scale per token and head: Qwen3-Omni's 49.5 KiB a token against 96 KiB in bfloat16, so about twice"
        " the tokens in gpu_cache_bytes, for a small loss of precision; GPUs of compute capability 8.9 or newer, and"
        " the CPU)",
    )
    host_cache_bytes: int = setting(
        -1,
        "host memory for chats' KV moved off the device, least recently used first; past it they are dropped;"
        " allocated at start-up (page-locked on a GPU, so taken from the machine's memory at once); -1: sized from"
        " the machine's memory (a quarter of what the weights held there leave, less the KV blocks on the CPU, at"
        " most 8 GiB); 0: none",
    )
    encoder_cache: bool = setting(
        True,
        "keep image, audio and video encoder outputs by content, so a known picture, clip or video skips its encoder",
    )
    encoder_cache_bytes: int = setting(
        1 << 30,
        "most device memory for encoder outputs, the least recently used dropped first; where the GPU memory plan is"
        " short, it gives less (down to 128 MiB) before the Thinker's KV holds fewer than four chats of 4,096 tokens",
    )
    disk_cache: bool = setting(True, "also keep encoder outputs on disk, across restarts")
    disk_cache_bytes: int = setting(8 << 30, "disk space for encoder outputs (<cache_dir>/encoders)")

    def _check(self) -> None:
        _positive(self, "gpu_cache_bytes", "kv_block_tokens", "encoder_cache_bytes", "disk_cache_bytes")
        _at_least_zero(self, "gpu_memory_bytes")
        if self.host_cache_bytes < -1:
            raise SettingsError("setting 'host_cache_bytes' must be -1 (sized from the machine's memory), 0 (none) or "
                                f"more, got {self.host_cache_bytes!r}")
        if self.kv_block_tokens & (self.kv_block_tokens - 1) or 256 % self.kv_block_tokens:
            raise SettingsError(f"setting 'kv_block_tokens' must be a power of two up to 256, got {self.kv_block_tokens}")

    @property
    def cache_path(self) -> Path:
        return Path(self.cache_dir).expanduser()


@dataclass(frozen=True)
class UISettings(_Group, table="ui"):
    """The chat page's server: where it listens, who may log in, how often a streaming reply is saved."""

    ui_host: str = setting(
        "127.0.0.1", "address the UI binds to; another address than loopback needs ui_credentials_file"
    )
    ui_port: int = setting(7860, "port the UI listens on")
    ui_credentials_file: str = setting(
        "",
        "private (0600) file of 'user:password' lines: the UI then asks for a login; needed to serve beyond"
        " 127.0.0.1",
    )
    ui_serves_api: bool = setting(
        False, "the page's port also serves the OpenAI-compatible API (/v1), on the page's engine"
    )
    ui_save_every_s: float = setting(
        1.0,
        "most seconds between saves of a streaming reply's text (it is also saved every 16 tokens): what a crash can"
        " lose of it",
    )

    def _check(self) -> None:
        _positive(self, "ui_port", "ui_save_every_s")
        _port(self, "ui_port")


@dataclass(frozen=True)
class ServerSettings(_Group, table="server"):
    """The OpenAI-compatible API server (`python -m omni_local serve`): address, keys, limits on requests."""

    api_host: str = setting(
        "127.0.0.1",
        "address `python -m omni_local serve` binds to; another address than loopback needs api_key_file",
    )
    api_port: int = setting(8000, "port the API listens on")
    allowed_hosts: str = setting(
        "",
        "more names the page and the API answer to, comma-separated (a reverse proxy's, e.g. 'chat.example.com');"
        " they always answer to 127.0.0.1, localhost, [::1] and their own host (on 0.0.0.0 or ::, this machine's"
        " name and addresses); other names get 400",
    )
    shutdown_grace_s: float = setting(
        5.0,
        "on Ctrl-C or SIGTERM, seconds `serve` lets replies still streaming go on; the rest end with an error event",
    )
    api_key_file: str = setting(
        "",
        "private (0600) file of the keys API clients may send (Authorization: Bearer KEY), one a line, 'KEY' or"
        " 'NAME: KEY', one per person",
    )
    api_max_requests: int = setting(
        32, "API requests held at once, streaming or waiting; one more is refused at once (429)"
    )
    api_local_files: bool = setting(
        False, "API messages may name files on this machine (file:// URLs) instead of sending them"
    )
    header_timeout_s: float = setting(
        10.0,
        "seconds a client has to send a request's headers, to the API or the page; then its connection is closed",
    )
    api_body_timeout_s: float = setting(
        60.0,
        "seconds an API request's body has to come, whole, after its headers; then 408, and the connection is closed",
    )
    api_body_budget_bytes: int = setting(
        512 << 20,
        "API request bodies held at once, all requests together; past it 429 (one body alone is always let in)",
    )

    def _check(self) -> None:
        _positive(self, "api_port", "api_max_requests", "header_timeout_s", "api_body_timeout_s",
                  "api_body_budget_bytes")
        _at_least_zero(self, "shutdown_grace_s")
        _port(self, "api_port")


@dataclass(frozen=True)
class BackendSettings(_Group, table="backend"):
    """Which backend answers: the engine in this process, or a remote server of OpenAI's chat API."""

    backend: Literal["local", "openai"] = setting(
        "local",
        "'local': the engine in this process; 'openai': a server of OpenAI's chat API at backend_url"
        " (omni_local serve, vLLM-Omni, SGLang-Omni)",
    )
    backend_url: str = setting("", "the remote server's API root, e.g. http://127.0.0.1:8000/v1")
    backend_api_key: str = setting("", "the key the remote server asks for; '' for none")
    backend_model: str = setting("", "the remote server's model id; '' takes the first it lists")
    backend_dialect: BackendDialect = setting(
        "auto",
        "how the remote server streams audio: 'openai' (delta.audio), 'vllm-omni' (WAV pieces in content chunks"
        " marked \"modality\": \"audio\", the voice sent as speaker), 'auto' tells them apart from the stream",
    )

    def _check(self) -> None:
        if self.backend == "openai" and not self.backend_url:
            raise SettingsError("setting 'backend' is 'openai': set 'backend_url' to the server's API, "
                                "e.g. http://127.0.0.1:8000/v1")


@dataclass(frozen=True)
class LimitSettings(_Group, table="limits"):
    """What a user may send: the largest files and media, the longest prompt."""

    max_upload_bytes: int = setting(50 << 20, "largest image, audio or video file accepted")
    max_image_pixels: int = setting(4096 * 4096, "largest decoded image, width times height")
    max_audio_seconds: float = setting(300.0, "longest audio clip accepted")
    max_video_seconds: float = setting(
        120.0, "longest video clip accepted (its frames also count against max_image_pixels)"
    )
    max_prompt_tokens: int = setting(
        6144,
        "longest prompt, media tokens included; a longer chat leaves its earliest turns out (never the system prompt"
        " or the question asked)",
    )

    def _check(self) -> None:
        _positive(self, "max_upload_bytes", "max_image_pixels", "max_audio_seconds", "max_video_seconds",
                  "max_prompt_tokens")


@dataclass(frozen=True)
class EngineConfig(CacheSettings, SpeechSettings, EngineSettings, ModelSettings):
    """The settings the engine reads (and the model loader, and the memory plan): [model], [engine],
    [speech] and [cache]. The bases are listed last first, as a dataclass takes its bases' fields
    from the last: so the fields stay in the tables' order."""

    def _check(self) -> None:
        if self.gpu_cache_bytes < self.min_gpu_cache_bytes:
            raise SettingsError(
                f"setting 'gpu_cache_bytes' ({self.gpu_cache_bytes:,}) is below the {self.min_gpu_cache_bytes:,} bytes "
                f"that one conversation of 'max_context_tokens' ({self.max_context_tokens}) takes with any model: "
                "raise the first or lower the second"
            )

    @property
    def min_gpu_cache_bytes(self) -> int:
        """The least KV one conversation needs, known before the model is: a key and a value per token
        (one layer, head and channel at the least) in the narrowest dtype the setting allows. The
        model's own size, checked once it is loaded, is larger (about 96 KiB per token for Qwen3-Omni)."""
        itemsize = 4 if self.dtype == "float32" else 2  # 'auto' may be bfloat16
        return self.max_context_tokens * 2 * itemsize

    @property
    def demo_path(self) -> Path:
        return Path(self.demo_dir).expanduser() if self.demo_dir else self.cache_path / "demo"


@dataclass(frozen=True)
class Settings(LimitSettings, BackendSettings, ServerSettings, UISettings, EngineConfig):
    """Every setting, read flat. It is an `EngineConfig` too (so whatever takes the engine's settings
    takes these), and `for_engine` gives the engine those groups alone. Bases last first, as in
    `EngineConfig`."""

    def _check(self) -> None:
        if self.max_prompt_tokens >= self.max_context_tokens:
            raise SettingsError(
                f"setting 'max_prompt_tokens' ({self.max_prompt_tokens}) must be below "
                f"'max_context_tokens' ({self.max_context_tokens}), to leave room for a reply"
            )

    def for_engine(self) -> EngineConfig:
        """The groups the engine reads, without the page's, the server's, the backend's and the limits."""
        return EngineConfig(**{f.name: getattr(self, f.name) for f in fields(EngineConfig)})


_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def expected_values(annotation: Any) -> str:
    """What a setting of this type may hold, as its error messages and docs/settings.md say it."""
    if get_origin(annotation) is Literal:
        return "one of " + ", ".join(repr(choice) for choice in get_args(annotation))
    return _TYPE_NAMES[annotation]


def _check_type(name: str, value: Any, annotation: Any) -> None:
    expected = annotation
    if get_origin(expected) is Literal:
        if value not in get_args(expected):
            raise SettingsError(f"setting '{name}' must be {expected_values(expected)}, got {value!r}")
        return
    ok = isinstance(value, expected) and not (expected is not bool and isinstance(value, bool))
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        raise SettingsError(f"setting '{name}' must be {expected_values(expected)}, got {value!r}")


def _field_table() -> dict[str, str]:
    return {f.name: f.metadata["table"] for f in fields(Settings)}


def read_settings_file(path: Path) -> dict[str, Any]:
    """The flat key/value pairs of a settings file; each key must sit in its own table."""
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SettingsError(f"settings file '{path}' does not exist") from None
    except tomllib.TOMLDecodeError as error:
        raise SettingsError(f"settings file '{path}' is not valid TOML: {error}") from None
    tables = _field_table()
    values: dict[str, Any] = {}
    for table, entries in document.items():
        if not isinstance(entries, dict):
            raise SettingsError(f"{path}: '{table}' must be a table such as [model], got a bare key")
        for key, value in entries.items():
            if key not in tables:
                raise SettingsError(f"{path}: unknown setting '{table}.{key}'")
            if tables[key] != table:
                raise SettingsError(f"{path}: setting '{key}' belongs in [{tables[key]}], not [{table}]")
            values[key] = value
    return values


def add_settings_arguments(parser: argparse.ArgumentParser) -> None:
    """One `--dashed-name` option per setting, plus `--settings FILE`."""
    group = parser.add_argument_group("settings (override settings.toml)")
    group.add_argument("--settings", type=Path, default=None, help="settings file (default: ./settings.toml)")
    for f in fields(Settings):
        flag = "--" + f.name.replace("_", "-")
        help = f.metadata["help"].replace("%", "%%")  # argparse formats help with '%'
        group.add_argument(flag, dest=f"setting_{f.name}", default=None, metavar="VALUE", help=help)


def settings_from_arguments(args: argparse.Namespace) -> Settings:
    overrides = {f.name: getattr(args, f"setting_{f.name}") for f in fields(Settings)}
    return load_settings(args.settings, {k: v for k, v in overrides.items() if v is not None})


def load_settings(path: Path | None = None, overrides: dict[str, str] | None = None) -> Settings:
    """Defaults, then the file (if any), then command-line strings parsed by each field's type."""
    if path is None:
        local = Path("settings.toml")
        path = local if local.exists() else (DEFAULT_SETTINGS_FILE if DEFAULT_SETTINGS_FILE.exists() else None)
    values = read_settings_file(path) if path is not None else {}
    types = {f.name: f.type for f in fields(Settings)}
    for name, text in (overrides or {}).items():
        if name not in types:
            raise SettingsError(f"unknown setting '{name}'")
        values[name] = _parse_override(name, text, types[name])
    return Settings(**values)


def _parse_override(name: str, text: str, expected: Any) -> Any:
    if get_origin(expected) is Literal or expected is str:
        return text
    if expected is bool:
        lowered = text.lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
        raise SettingsError(f"setting '{name}' must be true or false, got {text!r}")
    try:
        return expected(text)
    except ValueError:
        raise SettingsError(f"setting '{name}' must be {_TYPE_NAMES[expected]}, got {text!r}") from None
