"""One typed, read-only settings object: `settings.toml`, then command-line overrides.

The TOML file groups keys in tables for the reader ([model], [engine], [speech], [cache], [ui],
[server], [backend], [limits]); every key name is unique across tables, so the command line can override any of them by
name (`--max-new-tokens 64`). Validation happens once, here: an unknown key or a value of the wrong
type is a `SettingsError` naming the key and what was expected. Each field's help is written once,
here: the command line's --help shows it, and settings.toml and docs/settings.md are written from it
(`python -m omni_local.settings_files`).
"""

import argparse
import dataclasses
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from omni_local.errors import SettingsError

# How a remote server streams spoken replies (backends/remote/): "auto" tells from the stream.
BackendDialect = Literal["auto", "openai", "vllm-omni"]
DEFAULT_SETTINGS_FILE = Path(__file__).resolve().parent.parent / "settings.toml"


def setting(table: str, default: Any, help: str) -> Any:
    """A settings field: its default, the TOML table it belongs in, and its one-line help."""
    return field(default=default, metadata={"table": table, "help": help})


@dataclass(frozen=True)
class Settings:
    # [model]
    model: str = setting("model", "demo", "a checkpoint folder, or 'demo': a tiny built-in model with random weights")
    device: str = setting("model", "auto", "'auto' (the GPU if there is one), 'cpu', 'cuda' or 'cuda:N'")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = setting(
        "model", "auto", "the weights' and activations' dtype; 'auto' is bfloat16 on a GPU, float32 on the CPU"
    )
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = setting(
        "model", "sdpa",
        "which attention transformers' own modules run (the encoders, and the Thinker's forwards that use"
        " transformers' attention); 'flash_attention_2' needs flash-attn installed",
    )
    speech: bool = setting(
        "model", False, "load the Talker and Code2Wav, for spoken replies; off saves their memory"
    )
    weights: Literal["bf16", "fp8", "int4"] = setting(
        "model", "bf16",
        "how the Thinker's and Talker's routed experts and attention projections are held: 'bf16' as the checkpoint"
        " has them (in dtype; a checkpoint quantized with compressed-tensors, W4A16 or FP8, as it was quantized),"
        " 'fp8' (float8 with a scale per output row; GPUs of compute capability 8.9 or newer), 'int4' (experts in 4"
        " bits with a scale per 128 inputs, attention projections in int8; any GPU our kernels run on): fewer bytes,"
        " so a smaller card and faster decode, at some quality; a bf16 checkpoint is quantized as it loads, and the"
        " result kept in cache_dir for the next start",
    )
    experts_on_gpu: int = setting(
        "model", -1,
        "how many of the Thinker's first layers keep their routed experts on the GPU; the rest keep them in"
        " page-locked host memory, and each decoded token reads its routed experts of those layers over the bus"
        " (about 19 MB a layer in int4: a card of 16 GB runs, slower); -1: the GPU memory plan decides (all on the"
        " GPU where they fit, else the fewest last layers in host memory that make it fit, up to half the machine's"
        " memory); on the CPU, nothing to move",
    )
    model_kind: Literal["auto", "instruct", "thinking", "captioner"] = setting(
        "model", "auto",
        "which Qwen3-Omni checkpoint it is; 'auto': one with a Talker is Instruct, one whose chat template opens a"
        " reasoning block is Thinking, one whose folder is named for the Captioner is the Captioner, another is"
        " Instruct without speech",
    )
    demo_dir: str = setting("model", "", "where the demo model is written; '' is <cache_dir>/demo")
    # [engine]
    max_context_tokens: int = setting("engine", 8192, "prompt plus reply, per request")
    max_running_requests: int = setting(
        "engine", 16,
        "requests computed at once: a decode step's largest batch (its CUDA graphs are captured up to it); more wait"
        " their turn",
    )
    compile: bool = setting(
        "engine", False,
        "compile the vision and audio encoders at start-up, so one graph serves every image size and clip length;"
        " it adds start-up time and gains nothing on the CPU",
    )
    cuda_graphs: bool = setting(
        "engine", True,
        "on a GPU, run the Thinker's decode steps (chats decoding at once as one batch) and prefills of up to"
        " prefill_forward_tokens, the Talker's and its code predictor's steps, and Code2Wav's chunks, as CUDA graphs"
        " captured at start-up (the app serves once the decode steps' graphs are captured, and captures the prefills'"
        " while idle); false: eager",
    )
    prefill_chunk_tokens: int = setting(
        "engine", 512,
        "while another reply is decoding or speaking, a prompt is computed in chunks of this many tokens, one per"
        " engine turn, each ending at a multiple of it, so that reply waits one chunk at a time, not for a whole long"
        " prompt (else in forwards of up to prefill_forward_tokens); smaller chunks make those waits shorter and a"
        " long prompt's first token later, as each chunk reads the experts' weights again; short prompts waiting"
        " together are computed in one turn while their tokens stay within it",
    )
    prefill_forward_tokens: int = setting(
        "engine", 4096,
        "with no other reply to wait, a prompt is computed in one forward of up to this many tokens (a longer one in"
        " forwards ending at multiples of it, so boundaries stay fixed by position; a multiple of"
        " prefill_chunk_tokens); on a GPU each forward replays a CUDA graph captured at start-up for its length"
        " rounded up (16, 32, ... to prefill_chunk_tokens, then four steps to each doubling: 640, 768, 896, 1024,"
        " 1280, ...): more takes more start-up time and GPU memory for the graphs; where the GPU memory plan falls"
        " short of its KV target, it halves this (down to prefill_chunk_tokens) before moving any expert",
    )
    chunk_every_prefill: bool = setting(
        "engine", False,
        "compute every prompt in chunks, even with no other reply to wait: slower alone, but each prompt is cut at"
        " the same rows whatever else runs",
    )
    compiled_layers: bool = setting(
        "engine", True,
        "on a GPU, run the work around attention in each decoder layer (norms, projections, rotary embedding, MoE"
        " routing and experts) as compiled regions, inside the CUDA graphs and in eager forwards: faster decode"
        " steps; compiling adds start-up time, least when inductor's cache has them",
    )
    moe_backend: Literal["auto", "torch", "triton"] = setting(
        "engine", "auto",
        "what runs the MoE layers' routed experts (Thinker and Talker): 'triton' (our kernels: fused routing, tokens"
        " sorted by expert, two grouped GEMMs), 'torch' (transformers' own modules), or 'auto' (triton on a CUDA GPU"
        " of compute capability 8.0 or newer, torch elsewhere); 'triton' where Triton cannot run is refused, saying"
        " why",
    )
    attention_backend: Literal["auto", "torch", "triton"] = setting(
        "engine", "auto",
        "what decode steps (the Thinker's and the Talker's) and graphed prefills on a cached prefix attend with:"
        " 'triton' (our kernel, reading each chat's KV blocks in place), 'torch' (transformers' attention over the"
        " rows gathered from the blocks), or 'auto' (triton on a CUDA GPU, torch elsewhere); a chat's first prefill,"
        " and an eager one, use transformers' attention over its own rows, unless deterministic",
    )
    deterministic: bool = setting(
        "engine", False,
        "a greedy reply never depends on the prefix cache, on the other chats decoding beside it or on how its prompt"
        " was split between cache and compute: every kernel on the Thinker's and the Talker's path computes a"
        " token's row alone (\"Deterministic mode\" in docs/architecture.md); slower decode steps and prefills, and"
        " it needs our Triton kernels (a CUDA GPU), so moe_backend and attention_backend may not be 'torch'",
    )
    video_fps: float = setting(
        "engine", 2.0,
        "video frames read per second (Qwen's default; the checkpoint's video processor's own rate if it sets one),"
        " at least 4 and at most 768 frames a clip",
    )
    use_audio_in_video: bool = setting(
        "engine", True,
        "the model also hears a video's sound track, interleaved with its frames by time (a silent clip gets silence)",
    )
    max_new_tokens: int = setting("engine", 512, "a reply's default length limit, in tokens")
    max_reasoning_tokens: int = setting(
        "engine", 0,
        "default; a Thinking checkpoint's reasoning ends after this many tokens and its answer begins; 0: only"
        " max_new_tokens limits it",
    )
    temperature: float = setting("engine", 0.0, "a reply's default sampling temperature; 0 is greedy")
    top_p: float = setting("engine", 1.0, "a reply's default nucleus sampling mass; 1 keeps every token")
    top_k: int = setting("engine", 0, "a reply's default top-k; 0 keeps every token")
    repetition_penalty: float = setting("engine", 1.0, "a reply's default repetition penalty; 1 is off")
    # [speech]
    voice: str = setting("speech", "Ethan", "default voice of spoken replies (one of the checkpoint's speakers)")
    first_audio_frames: int = setting(
        "speech", 2, "codec frames (80 ms of audio each) in a spoken reply's first audio chunk: few, for an early first"
        " sound"
    )
    audio_chunk_frames: int = setting(
        "speech", 10,
        "most codec frames in an audio chunk: chunks double from first_audio_frames up to this, so each is ready"
        " before the one playing ends; larger chunks cost Code2Wav less per frame",
    )
    audio_left_context_frames: int = setting(
        "speech", 25,
        "earlier frames Code2Wav sees before each chunk (Qwen's own choice); more is closer to one decode of the"
        " whole reply, and slower",
    )
    max_speech_seconds: float = setting("speech", 120.0, "longest spoken reply")
    # [cache]
    cache_dir: str = setting(
        "cache", "~/.cache/omni_local",
        "private folder for the app's data: the demo model, saved chats and uploads, encoder outputs, quantized"
        " weights, compiled kernels, the measured memory plan",
    )
    prefix_cache: bool = setting(
        "cache", True,
        "keep each chat's KV for its next turn and for chats that start the same way, so they compute only what is"
        " new; false keeps nothing",
    )
    gpu_memory_bytes: int = setting(
        "cache", 0,
        "GPU memory the app plans with at start-up: the weights, the engine's graphs and activations, encoder"
        " outputs, then KV up to gpu_cache_bytes; 0: what the GPU reports free, less 1 GiB (on the CPU, no plan"
        " unless it is set)",
    )
    gpu_cache_bytes: int = setting(
        "cache", 4 << 30,
        "most device memory for the Thinker's KV (less where the memory plan leaves less; on the CPU, where the host"
        " memory plan does), allocated at start-up as blocks every chat draws from: it decides how many tokens of"
        " chats stay on the device (Qwen3-Omni in bfloat16 takes 96 KiB a token)",
    )
    kv_block_tokens: int = setting(
        "cache", 16,
        "tokens per KV block, a power of two up to 256: the unit chats share of a common prefix, and the least a chat"
        " holds",
    )
    kv_dtype: Literal["auto", "fp8"] = setting(
        "cache", "auto",
        "how the Thinker's KV is stored: 'auto' (in the model's dtype) or 'fp8' (float8 e4m3 with a scale per token"
        " and head: Qwen3-Omni's 49.5 KiB a token against 96 KiB in bfloat16, so about twice the tokens in"
        " gpu_cache_bytes, for a small loss of precision; GPUs of compute capability 8.9 or newer, and the CPU)",
    )
    host_cache_bytes: int = setting(
        "cache", -1,
        "host memory for chats' KV moved off the device, least recently used first; past it they are dropped;"
        " allocated at start-up (page-locked on a GPU, so taken from the machine's memory at once); -1: sized from"
        " the machine's memory (a quarter of what the weights held there leave, less the KV blocks on the CPU, at"
        " most 8 GiB); 0: none",
    )
    encoder_cache: bool = setting(
        "cache", True,
        "keep image, audio and video encoder outputs by content, so a known picture, clip or video skips its encoder",
    )
    encoder_cache_bytes: int = setting(
        "cache", 1 << 30,
        "most device memory for encoder outputs, the least recently used dropped first; where the GPU memory plan is"
        " short, it gives less (down to 128 MiB) before the Thinker's KV holds fewer than four chats of 4,096 tokens",
    )
    disk_cache: bool = setting("cache", True, "also keep encoder outputs on disk, across restarts")
    disk_cache_bytes: int = setting("cache", 8 << 30, "disk space for encoder outputs (<cache_dir>/encoders)")
    # [ui]
    ui_host: str = setting(
        "ui", "127.0.0.1", "address the UI binds to; another address than loopback needs ui_credentials_file"
    )
    ui_port: int = setting("ui", 7860, "port the UI listens on")
    ui_credentials_file: str = setting(
        "ui", "",
        "private (0600) file of 'user:password' lines: the UI then asks for a login; needed to serve beyond"
        " 127.0.0.1",
    )
    ui_serves_api: bool = setting(
        "ui", False, "the page's port also serves the OpenAI-compatible API (/v1), on the page's engine"
    )
    ui_save_every_s: float = setting(
        "ui", 1.0,
        "most seconds between saves of a streaming reply's text (it is also saved every 16 tokens): what a crash can"
        " lose of it",
    )
    # [server]
    api_host: str = setting(
        "server", "127.0.0.1",
        "address `python -m omni_local serve` binds to; another address than loopback needs api_key_file",
    )
    api_port: int = setting("server", 8000, "port the API listens on")
    allowed_hosts: str = setting(
        "server", "",
        "more names the page and the API answer to, comma-separated (a reverse proxy's, e.g. 'chat.example.com');"
        " they always answer to 127.0.0.1, localhost, [::1] and their own host (on 0.0.0.0 or ::, this machine's"
        " name and addresses); other names get 400",
    )
    shutdown_grace_s: float = setting(
        "server", 5.0,
        "on Ctrl-C or SIGTERM, seconds `serve` lets replies still streaming go on; the rest end with an error event",
    )
    api_key_file: str = setting(
        "server", "",
        "private (0600) file of the keys API clients may send (Authorization: Bearer KEY), one a line, 'KEY' or"
        " 'NAME: KEY', one per person",
    )
    api_max_requests: int = setting(
        "server", 32, "API requests held at once, streaming or waiting; one more is refused at once (429)"
    )
    api_local_files: bool = setting(
        "server", False, "API messages may name files on this machine (file:// URLs) instead of sending them"
    )
    header_timeout_s: float = setting(
        "server", 10.0,
        "seconds a client has to send a request's headers, to the API or the page; then its connection is closed",
    )
    api_body_timeout_s: float = setting(
        "server", 60.0,
        "seconds an API request's body has to come, whole, after its headers; then 408, and the connection is closed",
    )
    api_body_budget_bytes: int = setting(
        "server", 512 << 20,
        "API request bodies held at once, all requests together; past it 429 (one body alone is always let in)",
    )
    # [backend]
    backend: Literal["local", "openai"] = setting(
        "backend", "local",
        "'local': the engine in this process; 'openai': a server of OpenAI's chat API at backend_url"
        " (omni_local serve, vLLM-Omni, SGLang-Omni)",
    )
    backend_url: str = setting("backend", "", "the remote server's API root, e.g. http://127.0.0.1:8000/v1")
    backend_api_key: str = setting("backend", "", "the key the remote server asks for; '' for none")
    backend_model: str = setting("backend", "", "the remote server's model id; '' takes the first it lists")
    backend_dialect: BackendDialect = setting(
        "backend", "auto",
        "how the remote server streams audio: 'openai' (delta.audio), 'vllm-omni' (WAV pieces in content chunks"
        " marked \"modality\": \"audio\", the voice sent as speaker), 'auto' tells them apart from the stream",
    )
    # [limits]
    max_upload_bytes: int = setting("limits", 50 << 20, "largest image, audio or video file accepted")
    max_image_pixels: int = setting("limits", 4096 * 4096, "largest decoded image, width times height")
    max_audio_seconds: float = setting("limits", 300.0, "longest audio clip accepted")
    max_video_seconds: float = setting(
        "limits", 120.0, "longest video clip accepted (its frames also count against max_image_pixels)"
    )
    max_prompt_tokens: int = setting(
        "limits", 6144,
        "longest prompt, media tokens included; a longer chat leaves its earliest turns out (never the system prompt"
        " or the question asked)",
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_type(f.name, getattr(self, f.name), f.type)
        positive = (
            "gpu_cache_bytes", "encoder_cache_bytes", "disk_cache_bytes", "max_context_tokens", "max_new_tokens",
            "max_upload_bytes", "max_image_pixels", "max_prompt_tokens", "ui_port", "max_audio_seconds",
            "first_audio_frames", "audio_chunk_frames", "audio_left_context_frames", "max_speech_seconds",
            "video_fps", "max_video_seconds", "api_port", "api_max_requests", "header_timeout_s",
            "api_body_timeout_s", "api_body_budget_bytes", "prefill_chunk_tokens",
            "prefill_forward_tokens", "max_running_requests", "kv_block_tokens", "ui_save_every_s",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise SettingsError(f"setting '{name}' must be positive, got {getattr(self, name)!r}")
        if self.host_cache_bytes < -1:
            raise SettingsError("setting 'host_cache_bytes' must be -1 (sized from the machine's memory), 0 (none) or "
                                f"more, got {self.host_cache_bytes!r}")
        if self.experts_on_gpu < -1:
            raise SettingsError("setting 'experts_on_gpu' must be -1 (the memory plan decides) or a number of layers, "
                                f"got {self.experts_on_gpu!r}")
        for name in ("max_reasoning_tokens", "gpu_memory_bytes", "shutdown_grace_s"):
            if getattr(self, name) < 0:
                raise SettingsError(f"setting '{name}' must be 0 or more, got {getattr(self, name)!r}")
        if self.max_prompt_tokens >= self.max_context_tokens:
            raise SettingsError(
                f"setting 'max_prompt_tokens' ({self.max_prompt_tokens}) must be below "
                f"'max_context_tokens' ({self.max_context_tokens}), to leave room for a reply"
            )
        if self.kv_block_tokens & (self.kv_block_tokens - 1) or 256 % self.kv_block_tokens:
            raise SettingsError(f"setting 'kv_block_tokens' must be a power of two up to 256, got {self.kv_block_tokens}")
        if self.prefill_forward_tokens % self.prefill_chunk_tokens:
            raise SettingsError(f"setting 'prefill_forward_tokens' ({self.prefill_forward_tokens}) must be a "
                                f"multiple of 'prefill_chunk_tokens' ({self.prefill_chunk_tokens})")
        for backend in ("moe_backend", "attention_backend"):
            if self.deterministic and getattr(self, backend) == "torch":
                raise SettingsError(f"setting 'deterministic' runs our Triton kernels, and '{backend}' is 'torch': "
                                    "set it to 'auto' or 'triton', or deterministic = false")
        for port in ("ui_port", "api_port"):
            if getattr(self, port) > 65535:
                raise SettingsError(f"setting '{port}' must be a port number, 1 to 65535, got {getattr(self, port)}")
        if self.backend == "openai" and not self.backend_url:
            raise SettingsError("setting 'backend' is 'openai': set 'backend_url' to the server's API, "
                                "e.g. http://127.0.0.1:8000/v1")
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
    def cache_path(self) -> Path:
        return Path(self.cache_dir).expanduser()

    @property
    def demo_path(self) -> Path:
        return Path(self.demo_dir).expanduser() if self.demo_dir else self.cache_path / "demo"

    def replace(self, **changes: Any) -> "Settings":
        unknown = sorted(set(changes) - {f.name for f in fields(self)})
        if unknown:
            raise SettingsError(f"unknown setting '{unknown[0]}'")
        return dataclasses.replace(self, **changes)


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
