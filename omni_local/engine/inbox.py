"""Requests on their way to the engine's worker. Each one's prompt is built on a thread of its own,
in the order they come (the chat template, the tokenizer, each medium's digest: milliseconds for a
long chat or a video), so the worker, whom every decoding chat waits on, never stops for one."""

import queue
import time
from concurrent.futures import ThreadPoolExecutor

from omni_local.engine.phases import BUILD_PROMPT, phase
from omni_local.engine.prompt.context_window import fit_prompt
from omni_local.engine.request import Request
from omni_local.errors import RequestError
from omni_local.model.reasoning import ReasoningMarks


class Inbox:
    def __init__(self, processor: object, max_prompt_tokens: int, reasoning_marks: ReasoningMarks | None) -> None:
        self.processor, self.max_prompt_tokens, self.reasoning_marks = processor, max_prompt_tokens, reasoning_marks
        self._builder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="omni-prompts")
        self._built: "queue.Queue[Request | None]" = queue.Queue()  # with their prompts; None: closing

    @property
    def queued(self) -> int:
        """Requests with their prompts built that the worker has yet to take."""
        return self._built.qsize()

    def put(self, request: Request) -> None:
        """Build `request`'s prompt after those of the requests put before it."""
        try:
            self._builder.submit(self._build, request)
        except RuntimeError as error:  # the builder is shut down
            raise RequestError("the engine was closed") from error

    def _build(self, request: Request) -> None:
        """On the builder's thread: `request`'s prompt, or why it has none; then it is the worker's."""
        building = time.perf_counter()
        try:
            with phase(BUILD_PROMPT):
                request.prompt, request.turns_left_out = fit_prompt(
                    request.messages, self.processor, self.max_prompt_tokens, self.reasoning_marks)
        except Exception as error:  # noqa: BLE001 - the worker fails the request, as any request's failure
            request.build_error = error
        request.prompt_built_s = time.perf_counter() - building
        self._built.put(request)

    def close(self) -> None:
        """Every request put reaches the worker, to serve or fail; then the worker is told to stop."""
        self._builder.shutdown(wait=True)
        self._built.put(None)

    def take(self, block: bool) -> tuple[list[Request], bool]:
        """The requests built since the last take (waiting for one if `block`), and False once the
        engine is closing."""
        taken: list[Request] = []
        try:
            item = self._built.get(block=block)
            while item is not None:
                taken.append(item)
                item = self._built.get_nowait()
            return taken, False
        except queue.Empty:
            return taken, True
