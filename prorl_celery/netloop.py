"""One event loop thread per process for the sockets that model-controlled code can reach: the
session gateways of a run worker (:mod:`prorl_celery.gateway.serving`) and the relays of a
sandbox host (:mod:`sandboxes.host.relay`).

A thread per connection let one sandbox's 1,200 idle connections make 1,200 threads in the
process every other session shares. Here a connection is a registered socket and a callback:
idle ones cost a descriptor and a few hundred bytes, and their deadlines are checked by one
sweep a second. Work that blocks (an LLM call) runs elsewhere, in a bounded pool; it hands
anything that touches the selector back with :meth:`Loop.call_soon` (only the loop's thread
registers, modifies or unregisters a socket)."""
from __future__ import annotations

import logging
import os
import selectors
import threading
import time
from collections import deque
from queue import Empty, SimpleQueue
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)
READ, WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE
SWEEP_S = 1.0  # how often deadlines are checked: timeouts here are seconds to minutes

_shared: dict[str, "Loop"] = {}
_shared_lock = threading.Lock()


class Loop:
    """A selector served by one daemon thread. ``register(sock, events, callback)``: the callback
    gets the ready mask; ``sweep(fn)``: ``fn(now)`` about once a second while registered."""

    def __init__(self, name: str):
        self.name = name
        self.pid = os.getpid()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._calls: deque[tuple[Callable[..., Any], tuple[Any, ...]]] = deque()
        self._sweeps: list[Callable[[float], None]] = []
        self._thread = threading.Thread(target=self._run, name=f"netloop-{name}", daemon=True)
        self._thread.start()

    @classmethod
    def shared(cls, name: str) -> "Loop":
        """This process's loop of that name (a new one in a forked child: threads do not fork)."""
        with _shared_lock:
            loop = _shared.get(name)
            if loop is None or loop.pid != os.getpid():
                loop = _shared[name] = cls(name)
            return loop

    def in_loop(self) -> bool:
        return threading.current_thread() is self._thread

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop's thread, after what it is doing now (never within the
        caller: it may hold a lock ``fn`` takes)."""
        self._calls.append((fn, args))
        if self.in_loop():
            return  # the loop runs its calls before it selects again
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:  # the pipe is full of wake-ups already: the loop is awake
            pass

    def call_and_wait(self, fn: Callable[..., Any], *args: Any, timeout: float = 10.0) -> None:
        """:meth:`call_soon`, then wait until it ran (closing a listener before its socket goes)."""
        if self.in_loop():
            fn(*args)
            return
        done = threading.Event()

        def run() -> None:
            try:
                fn(*args)
            finally:
                done.set()

        self.call_soon(run)
        done.wait(timeout)

    def register(self, sock: Any, events: int, callback: Callable[[int], None]) -> None:
        self._selector.register(sock, events, callback)

    def modify(self, sock: Any, events: int, callback: Callable[[int], None]) -> None:
        """Change what ``sock`` is watched for; 0 events: not watched (still known)."""
        key = self._selector.get_map().get(sock.fileno())
        if events == 0:
            if key is not None:
                self._selector.unregister(sock)
        elif key is None:
            self._selector.register(sock, events, callback)
        elif key.events != events or key.data is not callback:
            self._selector.modify(sock, events, callback)

    def unregister(self, sock: Any) -> None:
        try:
            self._selector.unregister(sock)
        except (KeyError, ValueError):  # never registered, paused, or already closed
            pass

    def add_sweep(self, fn: Callable[[float], None]) -> None:
        self.call_soon(self._sweeps.append, fn)

    def remove_sweep(self, fn: Callable[[float], None]) -> None:
        self.call_soon(lambda: fn in self._sweeps and self._sweeps.remove(fn))

    def _run(self) -> None:
        next_sweep = time.monotonic() + SWEEP_S
        while True:
            timeout = max(0.0, next_sweep - time.monotonic()) if self._sweeps else None
            for key, mask in self._selector.select(timeout):
                if key.data is None:
                    self._drain_wake()
                    continue
                self._guarded(key.data, (mask,))
            while self._calls:
                fn, args = self._calls.popleft()
                self._guarded(fn, args)
            now = time.monotonic()
            if now >= next_sweep:
                next_sweep = now + SWEEP_S
                for fn in list(self._sweeps):
                    self._guarded(fn, (now,))

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _guarded(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - one connection's fault never stops the loop
            log.exception("netloop %s: %r failed", self.name, fn)


class CallPool:
    """At most ``size`` threads, started as work comes, taking ``(fn, args)`` off one queue: the
    loop's way to run what blocks. (A ThreadPoolExecutor's futures cost ~15 us a call that no
    caller here waits on.)"""

    def __init__(self, size: int, name: str):
        self.size, self.name = size, name
        self._queue: SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]] | None] = SimpleQueue()
        self._lock = threading.Lock()
        self._threads = self._idle = 0
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn(*args)``; RuntimeError once shut down."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"call pool {self.name} is shut down")
            start = self._idle <= 0 and self._threads < self.size
            if start:
                self._threads += 1
            else:
                self._idle -= 1  # one idle thread is spoken for (or it queues behind busy ones)
        self._queue.put((fn, args))
        if start:
            threading.Thread(target=self._work, name=f"{self.name}-{self._threads}", daemon=True).start()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, args = item
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - the caller's work answers its own failures
                log.exception("call pool %s: %r failed", self.name, fn)
            with self._lock:
                self._idle += 1

    def shutdown(self) -> None:
        """No more work; the threads end once what they run returns (queued work is dropped)."""
        with self._lock:
            self._closed, threads = True, self._threads
        while True:  # what was queued and not started
            try:
                if self._queue.get_nowait() is None:
                    continue
            except Empty:
                break
        for _ in range(threads):
            self._queue.put(None)
