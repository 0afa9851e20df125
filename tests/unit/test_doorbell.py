"""Doorbells wake a waiting rank; unrung, a wait times out; rings are drained, not counted."""

from __future__ import annotations

import threading

from hpcrl.controller.doorbell import Doorbell


def test_ring_wakes_a_waiting_rank_and_is_drained() -> None:
    waiter, sender = Doorbell(), Doorbell()
    try:
        assert waiter.wait(0.0) is False
        for _ in range(3):
            sender.ring(("127.0.0.1", waiter.port))
        assert waiter.wait(30.0) is True
        assert waiter.wait(0.0) is False  # all three rings were drained by the one wake-up
    finally:
        waiter.close()
        sender.close()


def test_ring_from_another_thread_ends_a_long_wait() -> None:
    waiter, sender = Doorbell(), Doorbell()
    try:
        timer = threading.Timer(0.05, sender.ring, args=(("127.0.0.1", waiter.port),))
        timer.start()
        assert waiter.wait(60.0) is True
        timer.join()
    finally:
        waiter.close()
        sender.close()


def test_ringing_an_unreachable_address_is_ignored() -> None:
    bell = Doorbell()
    try:
        bell.ring(("203.0.113.1", 9))  # TEST-NET-3: nobody listens; must not raise
        bell.ring(("127.0.0.1", 0))
    finally:
        bell.close()
