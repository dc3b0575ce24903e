"""Seats: a running request's row in the sampler, taken and given back apart from its KV (no model)."""

import pytest

from omni_local.engine.seats import Seats


def test_seats_are_taken_lowest_first_and_a_seat_given_back_is_taken_again():
    seats = Seats(3)
    assert [seats.take(), seats.take()] == [0, 1]
    seats.give_back(0)
    assert seats.free == 2 and seats.take() == 0


def test_taking_a_seat_when_none_is_free_is_refused():
    seats = Seats(1)
    seats.take()
    with pytest.raises(AssertionError, match="more requests running than seats"):
        seats.take()


def test_a_seat_given_back_twice_is_refused():
    seats = Seats(2)
    seats.give_back(seats.take())
    with pytest.raises(AssertionError, match="seat 0 is not taken"):
        seats.give_back(0)
