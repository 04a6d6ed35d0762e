"""LoopMailboxes: the engine thread's outputs reach asyncio queues in order, with one loop
wake-up per `wake_all` however many items were posted, and nothing is lost when items are
posted while a delivery drains."""
from __future__ import annotations

import asyncio
import threading

from specserve.engine.loop_mailbox import LoopMailboxes


def test_one_wake_up_delivers_a_steps_items_in_order():
    async def run() -> tuple[list, list, int]:
        loop = asyncio.get_running_loop()
        boxes = LoopMailboxes()
        box = boxes.of(loop)
        assert boxes.of(loop) is box
        first, second = asyncio.Queue(), asyncio.Queue()
        wake_ups = 0
        real = loop.call_soon_threadsafe

        def counting(*args):
            nonlocal wake_ups
            wake_ups += 1
            return real(*args)

        loop.call_soon_threadsafe = counting

        def engine_thread() -> None:   # one "step": 3 items for each of two requests
            for i in range(3):
                box.post(first, ("a", i))
                box.post(second, ("b", i))
            boxes.wake_all()
            boxes.wake_all()   # already scheduled: no second wake-up

        thread = threading.Thread(target=engine_thread)
        thread.start()
        got_a = [await first.get() for _ in range(3)]
        got_b = [await second.get() for _ in range(3)]
        thread.join()
        return got_a, got_b, wake_ups

    got_a, got_b, wake_ups = asyncio.run(run())
    assert got_a == [("a", 0), ("a", 1), ("a", 2)]
    assert got_b == [("b", 0), ("b", 1), ("b", 2)]
    assert wake_ups == 1


def test_items_posted_across_many_steps_all_arrive():
    async def run() -> list[int]:
        boxes = LoopMailboxes()
        box = boxes.of(asyncio.get_running_loop())
        sink: asyncio.Queue = asyncio.Queue()

        def engine_thread() -> None:
            for i in range(5000):
                box.post(sink, i)
                if i % 7 == 0:
                    boxes.wake_all()
            boxes.wake_all()

        thread = threading.Thread(target=engine_thread)
        thread.start()
        got = [await sink.get() for _ in range(5000)]
        thread.join()
        return got

    assert asyncio.run(run()) == list(range(5000))


def test_a_closed_loop_drops_its_mail_and_is_forgotten():
    boxes = LoopMailboxes()
    old_loop = asyncio.new_event_loop()
    box = boxes.of(old_loop)
    old_loop.close()
    box.post(asyncio.Queue(), "late")
    boxes.wake_all()   # no error: nobody is left to read it
    new_loop = asyncio.new_event_loop()
    try:
        assert boxes.of(new_loop) is not box
        assert [b.loop for b in boxes._boxes] == [new_loop]
    finally:
        new_loop.close()
