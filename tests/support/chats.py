"""One conversation held twice, in an app with every cache on and one with every cache off (conftest's
`apps`): each reply is checked to be the same in both, so a test of what the cache reuses also shows
that it changed nothing. And the counts a cache hit is checked against: the ids two prompts share,
and the tokens a turn leaves in the cache for the next."""

import replies
from omni_local.api import Finished, OmniLocal, Session


class Chat:
    """A text conversation in both apps; `send` returns the cached app's reply."""

    def __init__(self, apps: tuple[OmniLocal, OmniLocal], system: str | None = None, new_tokens: int = 6) -> None:
        self.apps, self.new_tokens = apps, new_tokens
        self.cached, self.uncached = (app.session(system_prompt=system) for app in apps)

    @property
    def sessions(self) -> tuple[Session, Session]:
        return self.cached, self.uncached

    def send(self, text: str, **media) -> Finished:
        on, off = (session.send(text, max_new_tokens=self.new_tokens, **media).result() for session in self.sessions)
        return self.same(on, off)

    @staticmethod
    def same(on: Finished, off: Finished) -> Finished:
        assert on.token_ids == off.token_ids, "the cache changed an answer"
        assert off.tokens.computed == off.tokens.prompt
        return on

    def edit_from(self, turn: int) -> None:
        """Drop history from user turn `turn` (0-based) on, as editing that message does."""
        for session in self.sessions:
            first_user = 1 if session.history and session.history[0].role == "system" else 0
            del session.history[first_user + 2 * turn :]


class SpokenChat(Chat):
    """A conversation of spoken replies (apps with speech on), as long as `replies.send` makes them
    by default: the speech must be the same too."""

    def __init__(self, apps: tuple[OmniLocal, OmniLocal], system: str | None = None,
                 new_tokens: int = replies.NEW_TOKENS) -> None:
        super().__init__(apps, system, new_tokens)

    def send(self, text: str, **media) -> Finished:
        (on, on_frames, _, _), (off, off_frames, _, _) = (
            replies.send(app, session, text, max_new_tokens=self.new_tokens, **media)
            for app, session in zip(self.apps, self.sessions)
        )
        self.same(on, off)
        assert on_frames == off_frames, "the cache changed the speech"
        assert off.speech.talker_reused == 0
        return on


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many ids two prompts share from the start: what one's cache entry can give the other."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def written_tokens(prompt: int, generated: int, stop_reason: str) -> int:
    """Tokens of prompt-then-reply whose KV a request left: the last sampled token is never fed. On an
    end of turn that is the end-of-turn token, which `generated` does not count."""
    return prompt + generated - (0 if stop_reason == "end_of_turn" else 1)


def written(final: Finished) -> int:
    """`written_tokens` of a finished reply."""
    return written_tokens(final.tokens.prompt, final.tokens.generated, final.stop_reason)
