"""Seats: a running request's place among the requests the engine runs at once, apart from where
its KV is.

A request's seat is its row in the sampler's device tables (parameters, seed, tokens seen, its
last token: the next decode step's input), held from admission until its text ends. Its KV is held
apart, through the prefix cache (a slot of the KV store today), so that how the KV is stored can
change without touching how a batch is sampled. Every running request holds a KV slot too, so
there are as many seats as KV slots and a request admitted always finds one.
"""


class Seats:
    def __init__(self, count: int) -> None:
        self.count = count
        self._free = list(range(count - 1, -1, -1))  # the lowest seat is taken first

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        assert self._free, "more requests running than seats: each holds a KV slot, and there are as many seats"
        return self._free.pop()

    def give_back(self, seat: int) -> None:
        assert 0 <= seat < self.count and seat not in self._free, f"seat {seat} is not taken"
        self._free.append(seat)
