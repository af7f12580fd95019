"""The bounded FIFO between a client's stream thread and the training loop."""
from __future__ import annotations

import threading
from collections import deque

END = object()   # the stream's end, queued after its last batch


class Handoff:
    """The bounded FIFO between the stream thread and the training loop.

    The stream thread adds runs of batches and the loop wakes it only once the queue is down
    to half, so the two threads trade the GIL once per run, not once per batch (per-batch
    hand-offs cost ~80 us a batch, more than decoding it). The end of the stream (END) or an
    error stays at the head, so every later take sees it too. Once closed, nothing more is
    queued and a take gets END: a loop blocked in one thread while another closes the client
    ends, and never gets a batch queued after the ones the close dropped."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.items: deque = deque()
        self.cv = threading.Condition()
        self.closed = False

    def put_many(self, items: list, stop: threading.Event) -> bool:
        """Queue `items` in order, waiting for room; False (the rest not queued) once `stop` is
        set or the queue closed."""
        i = 0
        with self.cv:
            while i < len(items):
                if self.closed or stop.is_set():
                    return False
                room = self.capacity - len(self.items)
                if room <= 0:
                    self.cv.wait(0.2)
                    continue
                self.items.extend(items[i:i + room])
                i += room
                self.cv.notify_all()
        return True

    def get(self):
        """The next item, waiting for one; END and errors are left in place."""
        with self.cv:
            while not self.items:
                if self.closed:
                    return END
                self.cv.wait()
            item = self.items[0]
            if item is END or isinstance(item, BaseException):
                return item
            self.items.popleft()
            if len(self.items) <= self.capacity // 2:
                self.cv.notify_all()
            return item

    def __len__(self) -> int:
        return len(self.items)

    def resize(self, capacity: int) -> None:
        with self.cv:
            self.capacity = capacity
            self.cv.notify_all()

    def close(self) -> None:
        """Drop what is queued and take nothing more (FeederClient.close)."""
        with self.cv:
            self.closed = True
            self.items.clear()
            self.cv.notify_all()
