"""What the API tests send `python -m omni_local serve` through the official `openai` client: a short
question, a long system prompt, a PNG as a data URL; and a file only its owner may read."""

import base64
import io

import openai

from samples import picture

SHORT = 12  # reply tokens, where the test does not need more
LONG_SYSTEM_PROMPT = " ".join(["You are a patient assistant who answers in full sentences."] * 30)


def ask(api: openai.OpenAI, content, max_tokens: int = SHORT, system: str | None = None, **fields):
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    return api.chat.completions.create(model="demo", messages=messages, max_tokens=max_tokens, **fields)


def private_file(path, text: str):
    path.write_text(text)
    path.chmod(0o600)
    return path


def data_url_part(kind: str, media_type: str, data: bytes) -> dict:
    return {"type": kind, kind: {"url": f"data:{media_type};base64,{base64.b64encode(data).decode()}"}}


def image_part(data: bytes) -> dict:
    return data_url_part("image_url", "image/png", data)


def png(seed: int, size: tuple[int, int] = (160, 120)) -> bytes:
    file = io.BytesIO()
    picture(seed, size).save(file, format="PNG")
    return file.getvalue()
