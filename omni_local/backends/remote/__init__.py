"""A remote server of OpenAI's chat API as the backend (`backend = "openai"`): the page, voice mode,
the CLI and the API's sessions run on it unchanged, and import neither torch nor the engine.

The official `openai` client does the HTTP, the server-sent events and the error statuses. Start-up
asks `GET {backend_url}/models` for the served model (`backend_model`, else the first listed); each
reply is one `POST /chat/completions` with `stream: true` and `stream_options.include_usage`, the
whole conversation in it (the API keeps no state; a server's prefix cache finds the shared prefix).

Requests (request.py). Content parts in the message's order: text as `{"type": "text"}`, an image as
an `image_url` PNG data URL, a clip as `input_audio` (a float32 WAV file, base64, `"format": "wav"`),
a video file as a `video_url` data URL of its own type. Sampling as `temperature`, `top_p`,
`max_completion_tokens` and `max_tokens`, `seed`, with `top_k` and `repetition_penalty` beside them
(vLLM's and SGLang's names). `modalities` is always named: `["text"]`, or `["text", "audio"]` for a
spoken reply, whose voice the two dialects name apart:
- OpenAI's (our `python -m omni_local serve`, mstar, SGLang-Omni): `"audio": {"voice": "Ethan",
  "format": "pcm16"}` and omni_local's own `"talker_temperature"` (others ignore it); the stream's `delta.audio` holds `data` (base64 PCM16, 24 kHz, mono) and
  `transcript` (the text), as OpenAI's API reference has it (ChatCompletionStreamResponseDeltaAudio:
  `id`, `data`, `transcript`, `expires_at`).
- vLLM-Omni's: the voice as a top-level `"speaker"` (examples/online_serving/qwen3_omni/README.md
  of vllm-project/vllm-omni, "Speaker selection": `extra_body={"speaker": "chelsie"}`; it takes the
  checkpoint's names in any case, Ethan, Chelsie and Aiden for Qwen3-Omni, as
  vllm_omni/entrypoints/openai/utils.py lower-cases them). Its stream (vllm_omni/entrypoints/openai/
  serving_chat.py, `chat_completion_stream_generator`) marks each chunk with a top-level
  `"modality"`: "text" chunks carry text in `delta.content`, "audio" chunks carry the sound in
  `delta.content` as base64 of a whole small WAV file (24 kHz for Qwen3-Omni), and only the
  modality that finishes last keeps its `finish_reason`. Its Thinker takes `max_tokens`, not the
  newer name, and it speaks unless `modalities` says otherwise.
`backend_dialect` picks one; "auto" reads the stream as OpenAI's until a chunk has a `modality`
(chunks.py), and names the voice both ways unless the model entry shows our own server.

Replies (reply.py, chunks.py, audio.py, figures.py): text as `TextDelta`, sound as `AudioChunk`s at
24 kHz (another rate is resampled), then one `Finished`. Its figures are our server's own where it
reports them (an `"omni_local"` object on the last chunk), else `usage` and what this side measures;
the rest is None, shown as unknown. Our server's model entry may hold an `"omni_local"` object too:
`{"speech", "voices", "max_prompt_tokens", "video", "runs_on", "model", "kind"}` (backend.py says what is
assumed of a server without it).

Errors: an error status is a `RequestError` with the server's own message (429 and 503: the server is
busy); an error event in the stream is one too; a server that cannot be reached or goes away is an
`OmniLocalError` naming its address.
"""

from omni_local.backends.remote.backend import RemoteBackend

__all__ = ["RemoteBackend"]
