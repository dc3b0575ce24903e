"""Seats: a running request's place among the requests the engine runs at once, apart from where
its KV is.

A request's seat is its row in the sampler's device tables (parameters, seed, tokens seen, its
last token: the next decode step's input), held from admission until its text ends. Its KV is held
apart, as blocks through the prefix cache, so that how the KV is stored can change without touching
how a batch is sampled. There are `max_running_requests` seats, the largest decode step's batch: a
request waits for a seat as it waits for blocks.
"""


class Seats:
    def __init__(self, count: int) -> None:
        self.count = count
        self._free = list(range(count - 1, -1, -1))  # the lowest seat is taken first

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        assert self._free, "more requests running than seats: admission waits for a free one"
        return self._free.pop()

    def give_back(self, seat: int) -> None:
        assert 0 <= seat < self.count and seat not in self._free, f"seat {seat} is not taken"
        self._free.append(seat)
