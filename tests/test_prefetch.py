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
