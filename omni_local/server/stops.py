"""A request's `stop` strings: the reply is cut where the first of them begins, and what comes
after is never sent. The text streams in pieces, and a stop string may span two of them, so the
end of the text that could still begin one is held back until the next piece tells."""


class StopStrings:
    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.stopped = False  # a stop string was found: the reply ends here
        self._held = ""

    def feed(self, text: str) -> str:
        """The part of `text` (after what was held back) that can be sent now."""
        if self.stopped:
            return ""
        text = self._held + text
        found = [at for at in (text.find(stop) for stop in self.stops) if at >= 0]
        if found:
            self.stopped, self._held = True, ""
            return text[:min(found)]
        held = max((n for stop in self.stops for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0)
        self._held = text[len(text) - held:] if held else ""
        return text[:len(text) - held]

    def flush(self) -> str:
        """What was held back, once the reply has ended without a stop string."""
        held, self._held = self._held, ""
        return held
