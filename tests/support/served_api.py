"""`python -m omni_local serve` as a user starts it, for the tests that meet the API from outside
(the official `openai` client): a subprocess on a free 127.0.0.1 port, on the demo model with the
tests' settings (those of conftest's `demo_settings` that decide a reply, so the in-process app
answers alike), every setting on its command line."""

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import openai

from served_app import ServedApp, free_port, serving

# The settings of `demo_settings` a reply depends on, passed as they are.
SHARED_SETTINGS = ("demo_dir", "device", "dtype", "gpu_cache_bytes", "max_context_tokens", "max_prompt_tokens")


@contextlib.contextmanager
def served_api(demo_settings, root: Path, *extra: str, key: str | None = None) -> Iterator[ServedApp]:
    """The API at `ServedApp.url` (".../v1"), its cache in `root`; `key`: the key its `extra` flags
    name a file of, which the readiness check then sends."""
    port = free_port()
    shared = [arg for name in SHARED_SETTINGS
              for arg in (f"--{name.replace('_', '-')}", str(getattr(demo_settings, name)))]
    command = [sys.executable, "-m", "omni_local", "serve", "--api-port", str(port), "--cache-dir", str(root / "cache"),
               *shared, *extra]
    url = f"http://127.0.0.1:{port}/v1"
    headers = {"Authorization": f"Bearer {key}"} if key else None
    with serving(command, url, f"{url}/models", root / "cache", root / "serve.log", headers) as served:
        yield served


def client(url: str, key: str | None = None, **options: object) -> openai.OpenAI:
    """The official client, which never retries here: a refusal must show as it is."""
    return openai.OpenAI(base_url=url, api_key=key or "no key", max_retries=0, **options)
