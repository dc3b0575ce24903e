"""Replies to compare: the engine's, as a session sends them, and transformers' own from `generate`,
greedy and NEW_TOKENS long (the parity, speech and CUDA graph tests)."""

import numpy as np
import torch
from PIL import Image

from omni_local.api import AudioChunk, Finished, OmniLocal, TextDelta
from omni_local.engine.prompt.builder import Prompt, build_prompt
from omni_local.engine.prompt.encoder_inputs import transformers_inputs
from omni_local.protocol.messages import Message

NEW_TOKENS = 24
GREEDY = {"speak": True, "talker_temperature": 0.0}  # a spoken reply, its codes greedy too


def media(parts: list) -> dict:
    """A message's pictures and clips, as `Session.send` takes them."""
    return {"images": [p for p in parts if isinstance(p, Image.Image)],
            "audio": [p for p in parts if isinstance(p, np.ndarray)]}


def send(app: OmniLocal, session, text: str, **options) -> tuple[Finished, list[list[int]], np.ndarray, list]:
    """A spoken reply's final event, codec frames, audio and event order ('T' text, 'A' audio)."""
    reply = session.send(text, **{"max_new_tokens": NEW_TOKENS, **GREEDY, **options})
    frames, order = [], []
    for event in reply:
        if isinstance(event, AudioChunk):
            frames += event.frames
            order.append("A")
        elif isinstance(event, TextDelta):
            order.append("T")
    return reply.result(), frames, reply.audio, order


def model_inputs(app: OmniLocal, prompt: Prompt) -> dict:
    """`prompt`'s inputs to transformers' generate, on the model's device, its pixels preprocessed
    there as the engine's are (on CUDA a resize rounds otherwise than on the CPU)."""
    device = app.backend.loaded.device
    inputs = transformers_inputs(prompt, app.backend.loaded.processor, device)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def reference_tokens(app: OmniLocal, messages: list[Message]) -> list[int]:
    """Greedy tokens from transformers' own generate, cut at (and without) the end of turn. The engine
    never lets a reply hold a media placeholder token, so neither may the reference."""
    prompt = build_prompt(messages, app.backend.loaded.processor)
    with torch.inference_mode():
        output = app.backend.loaded.model.thinker.generate(
            **model_inputs(app, prompt), max_new_tokens=NEW_TOKENS, do_sample=False,
            suppress_tokens=app.backend.engine.suppressed_ids,
        )
    tokens = output[0, prompt.num_tokens :].tolist()
    eos = set(app.backend.engine.eos_ids)
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[:i]
    return tokens


def model_logprobs(app: OmniLocal, messages: list[Message], reply_ids: list[int]) -> torch.Tensor:
    """[len(reply_ids), vocab]: at each token of a reply to `messages`, the log-softmax of the logits
    of transformers' own forward of the prompt and the reply before it, over the ids a reply may hold
    (the media markup the engine never chooses left out)."""
    prompt = build_prompt(messages, app.backend.loaded.processor)
    ids = torch.cat([prompt.input_ids, torch.tensor([reply_ids])], dim=1).to(app.backend.loaded.device)
    with torch.inference_mode():
        logits = app.backend.loaded.model.thinker(input_ids=ids).logits[0, prompt.num_tokens - 1 : -1].float()
        logits[:, app.backend.engine.suppressed_ids] = float("-inf")
        return logits.log_softmax(dim=-1).cpu()


def transformers_speech(app: OmniLocal, messages: list[Message], voice: str) -> tuple[list[int], torch.Tensor]:
    """Greedy text and codes [groups, frames] from transformers' `generate(return_audio=True)`."""
    model, engine = app.backend.loaded.model, app.backend.engine
    prompt = build_prompt(messages, app.backend.loaded.processor)
    decoded = []
    original = model.code2wav.chunked_decode

    def keep_codes(codes: torch.Tensor, **kwargs) -> torch.Tensor:
        decoded.append(codes[0].clone())
        return original(codes, **kwargs)

    model.code2wav.chunked_decode = keep_codes
    try:
        with torch.inference_mode():
            sequences, _ = model.generate(
                **model_inputs(app, prompt), speaker=voice,
                thinker_max_new_tokens=NEW_TOKENS, thinker_do_sample=False,
                thinker_eos_token_id=sorted(engine.eos_ids), thinker_suppress_tokens=engine.suppressed_ids,
                talker_do_sample=False, talker_max_new_tokens=engine.speaker.max_frames + 1,
            )
    finally:
        model.code2wav.chunked_decode = original
    text = [t for t in sequences[0, prompt.num_tokens :].tolist() if t not in engine.eos_ids]
    return text, decoded[0]


def assert_written_reply_is_generates(app: OmniLocal, parts: list, videos: list = ()) -> None:
    """A greedy reply to a user turn of `parts` (pictures, clips, then its text; `videos` among them
    sent as videos) equals transformers' own generate on the app's model, and is not trivially short."""
    final = app.session().send(parts[-1], videos=list(videos), max_new_tokens=NEW_TOKENS, **media(parts)).result()
    assert final.token_ids == reference_tokens(app, [Message("user", parts)])
    assert len(final.token_ids) > 8


def assert_spoken_reply_is_generates(app: OmniLocal, text: str) -> None:
    """A spoken greedy reply to `text` has the text and codes of transformers' own
    `generate(return_audio=True)` on the app's model."""
    final, frames, _, _ = send(app, app.session(), text, voice="Chelsie")
    tokens, codes = transformers_speech(app, [Message("user", [text])], "Chelsie")
    assert final.token_ids == tokens and len(tokens) > 8
    assert frames == codes.T.tolist() and final.speech.frames > 0

