"""batching.prefetch: the background reader keeps order, raises its errors in the consumer, and ends its thread
when the consumer stops early (a signal or an error in the training loop), even with a full queue."""

from __future__ import annotations

import threading
from contextlib import closing

import pytest

from llmtrain.data.batching import prefetch


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "llmtrain-prefetch"]


def test_order_is_unchanged():
    assert list(prefetch(iter(range(50)), depth=2)) == list(range(50))
    assert not _prefetch_threads()


def test_an_error_in_the_reader_is_raised_in_the_consumer():
    def broken():
        yield 1
        raise ValueError("row 7 is damaged")

    got = []
    with pytest.raises(ValueError, match="row 7"):
        for item in prefetch(broken()):
            got.append(item)
    assert got == [1] and not _prefetch_threads()


@pytest.mark.parametrize("consumed", [0, 1, 5])
def test_stopping_early_ends_the_thread(consumed):
    read = []

    def endless():
        i = 0
        while True:
            read.append(i)
            yield i
            i += 1

    stream = prefetch(endless(), depth=2)
    with closing(stream):
        for i, item in enumerate(stream):
            if i == consumed:
                break
    # closed with a full queue: the reader saw the stop and returned, and was joined before close() returned
    assert not _prefetch_threads()
    assert len(read) <= consumed + 1 + 2 + 1  # consumed, the queue's depth, and the one in hand


def test_the_thread_lives_until_the_consumer_is_done():
    """The reader's thread does not exit while the last items are trained on (issue 53, item 7): a thread that ran
    torch's OpenMP regions and exited mid-run made the last 2 steps of a 30-step CPU run ~20x slower. It ends when
    the consumer finishes."""
    import time

    stream = prefetch(iter(range(5)), depth=2)
    alive_at_last = None
    for item in stream:
        if item == 4:
            time.sleep(0.3)  # the reader has long made its last item and its end marker
            alive_at_last = bool(_prefetch_threads())
    assert alive_at_last is True
    assert not _prefetch_threads()
