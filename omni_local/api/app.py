"""The app: settings, and the backend that answers (the engine here, or a remote server)."""

from pathlib import Path

from omni_local.access import LOCAL_USER
from omni_local.api.arguments import VIDEOS, checked
from omni_local.api.session import Session, VideoInput, sampling_params
from omni_local.media import MediaLimits
from omni_local.protocol.backend import Backend, BackendInfo
from omni_local.protocol.messages import Part
from omni_local.protocol.params import SamplingParams
from omni_local.settings import Settings, load_settings


class OmniLocal:
    """One per process: the settings and their backend."""

    def __init__(self, settings: Settings | None = None, loaded: object = None, wait_for_graphs: bool = True) -> None:
        """`loaded`: a model already in memory (the benchmark's random full-size weights) for the
        local backend; by default the checkpoint the settings name is loaded. `wait_for_graphs`: on
        a GPU, return once every CUDA graph is captured (as a benchmark wants); False: once the
        engine serves (as a person waiting for the page wants), its prefill graphs captured while it
        is idle, a prompt meanwhile computed eagerly."""
        self.settings = settings or load_settings()
        self.limits = MediaLimits.from_settings(self.settings)
        self.backend: Backend = _backend(self.settings, loaded, wait_for_graphs)

    @property
    def info(self) -> BackendInfo:
        return self.backend.info

    def session(self, system_prompt: str | None = None, session_id: str | None = None,
                principal: str = LOCAL_USER) -> Session:
        """A new chat; `session_id` names it for the prefix cache (a fresh one by default). `principal`
        says whose it is (access.py): caches are shared only among one principal's chats."""
        return Session(self.backend, self.settings, self.limits, system_prompt, session_id, principal)

    def sampling(self, **overrides: object) -> SamplingParams:
        """Sampling parameters: the settings' defaults, with a request's own values on top."""
        return sampling_params(self.settings, **overrides)

    def read_video(self, item: VideoInput | str | Path) -> Part:
        """The video as the backend takes it: decoded here, or checked and sent on as a file."""
        return self.backend.read_video(checked("video", item, VIDEOS))

    def close(self) -> None:
        self.backend.close()

    def __enter__(self) -> "OmniLocal":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _backend(settings: Settings, loaded: object, wait_for_graphs: bool) -> Backend:
    # Imported here, not above: the local backend brings torch and transformers, which a page or CLI
    # on a remote backend never needs.
    if settings.backend == "local":
        from omni_local.backends.local import LocalBackend

        return LocalBackend(settings, loaded, wait_for_graphs)
    from omni_local.backends.remote import RemoteBackend

    return RemoteBackend(settings)
