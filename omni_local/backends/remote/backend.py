"""A server of OpenAI's chat API as a backend: what it serves, from its model list, and replies
streamed from it."""

from pathlib import Path
from typing import Any, get_args

import httpx
import openai

from omni_local.access import LOCAL_USER, cache_key_of
from omni_local.backends.remote.chunks import ChunkReader
from omni_local.backends.remote.errors import request_error, unreachable
from omni_local.backends.remote.figures import Asked
from omni_local.backends.remote.reply import RemoteReply
from omni_local.backends.remote.request import VIDEO_AS_FILE, chat_body
from omni_local.errors import MediaError, OmniLocalError, RequestError
from omni_local.media import MediaLimits
from omni_local.media.video import Video, VideoFile, read_video_file
from omni_local.protocol.backend import BackendInfo
from omni_local.protocol.events import ContextUse
from omni_local.protocol.kinds import ModelKind, conversation_for
from omni_local.protocol.messages import Message
from omni_local.protocol.params import SamplingParams, SpeechParams
from omni_local.protocol.tools import ToolUse
from omni_local.settings import BackendDialect, Settings

# Chats the page lets stream at once. A server queues what it cannot decode together (and answers
# 429 or 503 when its queue is full), so this bounds only what one page asks of it.
CONCURRENCY = 16
# Qwen3-Omni's voices, as its checkpoint names them: assumed where a server does not list its own.
QWEN3_OMNI_VOICES = ["Aiden", "Chelsie", "Ethan"]
# Of a context that a server reports without a prompt limit, the share a prompt may take: the
# rest is room for the reply (the settings' defaults split 8,192 alike).
PROMPT_SHARE = 0.75
# A server just started may not listen yet: the model list is asked again twice, with the client's
# backoff. A reply is never sent twice: the server would make it twice, and a full queue's 429
# should reach the person at once.
START_UP_RETRIES = 2
TIMEOUT = httpx.Timeout(600.0, connect=10.0)  # a read waits for the next chunk, as long as a long prefill
# A reply's connection is not reused: `cancel` shuts its socket down (reply.py).
OWN_CONNECTION = {"Connection": "close"}
NO_KEY = "EMPTY"  # sent where the setting has none: the client needs one, and vLLM's docs use this


class RemoteBackend:
    def __init__(self, settings: Settings, http_client: httpx.Client | None = None) -> None:
        """`http_client`: the HTTP client to use (tests give one with a mock transport)."""
        self.settings = settings
        self.limits = MediaLimits.from_settings(settings)
        self.url = settings.backend_url.rstrip("/")
        self.client = openai.OpenAI(
            base_url=self.url, api_key=settings.backend_api_key or NO_KEY, max_retries=START_UP_RETRIES,
            timeout=TIMEOUT, http_client=http_client,
            # An OpenAI account's ids in the environment are not this server's business.
            default_headers={"OpenAI-Organization": openai.omit, "OpenAI-Project": openai.omit},
        )
        entry = self._model_entry()
        extension = entry.get("omni_local")
        self.extension: dict[str, Any] | None = extension if isinstance(extension, dict) else None
        self.info = server_info(entry, self.extension, self.url, settings)
        self._chat = self.client.with_options(max_retries=0).chat.completions

    def send(self, session: str, messages: list[Message], params: SamplingParams,
             speech: SpeechParams | None, principal: str = LOCAL_USER, tools: ToolUse | None = None) -> RemoteReply:
        """A reply streamed from the server; the request is sent when its events are first read.
        `session` is not sent: the API is stateless, and a server's prefix cache matches content.
        The server knows this backend by its key (`backend_api_key`), for all its users: a principal
        other than the local user (a user of the page) is sent as a `prompt_cache_key` of its own, so
        the users share no cache there either (access.py)."""
        if speech is not None and not self.info.speech:
            raise RequestError(f"the server at {self.url} makes no spoken replies (its model has no Talker)")
        messages = conversation_for(self.info.kind, messages)
        body = chat_body(self.info.model_id, messages, params, speech, self._request_dialect(), tools)
        fields = {"model", "messages", "stream"}  # the rest goes as it is, typed fields and extensions alike
        extra = {key: value for key, value in body.items() if key not in fields}
        if principal != LOCAL_USER:
            extra["prompt_cache_key"] = cache_key_of(principal)
        asked = Asked(params.seed, speech.voice if speech else None,
                      ContextUse(self.info.max_context_tokens, self.info.max_prompt_tokens))
        return RemoteReply(
            lambda: self._chat.create(model=body["model"], messages=body["messages"], stream=True, extra_body=extra,
                                      extra_headers=OWN_CONNECTION),
            ChunkReader(self.settings.backend_dialect, spoken=speech is not None, logprobs=params.logprobs is not None),
            asked, self.url,
        )

    def read_video(self, item: str | Path | bytes | Video) -> VideoFile:
        """A video file as it is, checked against the limits; the server decodes it."""
        if isinstance(item, Video):
            raise MediaError(VIDEO_AS_FILE)
        return read_video_file(item, self.limits)

    def close(self) -> None:
        self.client.close()

    def _request_dialect(self) -> BackendDialect:
        """How a request names the voice: as the setting says; on "auto", OpenAI's way for our own
        server (its model entry says it is), and both ways for any other."""
        if self.settings.backend_dialect != "auto":
            return self.settings.backend_dialect
        return "openai" if self.extension is not None else "auto"

    def _model_entry(self) -> dict[str, Any]:
        """The served model's entry in `GET /models`: `backend_model`'s, else the first listed."""
        try:
            response = self.client.models.with_raw_response.list().http_response
            models = response.json()["data"]
            entries = [entry for entry in models if isinstance(entry, dict) and isinstance(entry.get("id"), str)]
        except openai.APIStatusError as error:
            if error.status_code == 404:
                raise self._not_an_api("answered 404") from None
            raise request_error(error, self.url) from None
        except openai.APIConnectionError as error:
            raise unreachable(self.url, error) from None
        except (ValueError, KeyError, TypeError):  # not JSON, or not a list of models
            raise self._not_an_api("did not list models") from None
        if not entries:
            raise OmniLocalError(f"the server at {self.url} lists no models")
        wanted = self.settings.backend_model
        if not wanted:
            return entries[0]
        found = next((entry for entry in entries if entry["id"] == wanted), None)
        if found is None:
            listed = ", ".join(entry["id"] for entry in entries)
            raise OmniLocalError(f"the server at {self.url} does not serve '{wanted}' (backend_model); "
                                 f"it serves {listed}")
        return found

    def _not_an_api(self, answer: str) -> OmniLocalError:
        return OmniLocalError(f"{self.url} is not an OpenAI-compatible API: GET /models {answer} "
                              "(backend_url names the API's root, e.g. http://127.0.0.1:8000/v1)")


def server_info(entry: dict[str, Any], extension: dict[str, Any] | None, url: str, settings: Settings) -> BackendInfo:
    """What a server's model entry says it serves. vLLM, SGLang and our server give the context
    size as `max_model_len`; ours adds an `"omni_local"` object with the rest. Without it, the
    model is taken to be Qwen3-Omni with its Talker (speech, its voices, video), a prompt may fill
    PROMPT_SHARE of the context, and a server that gives no context size is taken to have the
    settings' (max_context_tokens, max_prompt_tokens)."""
    ours = extension or {}
    context = entry.get("max_model_len")
    if isinstance(context, int) and context > 1:
        prompt = int(context * PROMPT_SHARE)
    else:
        context, prompt = settings.max_context_tokens, settings.max_prompt_tokens
    prompt = ours.get("max_prompt_tokens") if isinstance(ours.get("max_prompt_tokens"), int) else prompt
    runs_on = f"remote: {url}" + (f" ({ours['runs_on']})" if isinstance(ours.get("runs_on"), str) else "")
    voices = ours.get("voices")
    return BackendInfo(
        model_id=entry["id"],
        model=ours["model"] if isinstance(ours.get("model"), str) else entry["id"],
        runs_on=runs_on,
        speech=bool(ours.get("speech", True)),
        voices=list(voices) if isinstance(voices, list) else list(QWEN3_OMNI_VOICES),
        max_context_tokens=context,
        max_prompt_tokens=min(prompt, context - 1),
        concurrency=CONCURRENCY,
        video=bool(ours.get("video", True)),
        kind=ours["kind"] if ours.get("kind") in get_args(ModelKind) else "instruct",
    )
