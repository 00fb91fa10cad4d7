"""The sandbox host's HTTP event loop: waitress's, at a cost per turn that follows the connections
that moved, not all those open.

Waitress's own loop (``wasyncore.poll2``) asks every connection whether it wants to read or write
and registers each in a new ``poll`` set, on every turn. The host holds one kept-alive connection
per run-worker thread that ever called it (1,000 at 1,000 sandboxes, idle between turns), and its
loop turns a few times per request (the request, the answer's trigger, the client's next
connection): so the host's CPU per request grew with its sandboxes, and its CPU per sandbox-second
with them (bench/RESULTS.md). Here one ``epoll`` set keeps each connection registered with the
interest it last had, and a turn asks again only those that may have changed since:

- those with an event on the last turn (the loop's thread handled them),
- those that were busy when last asked (a request being served, output pending, closing: a
  worker thread changes a connection only while it serves one of its requests),
- those added to or removed from the map (a new connection, a closed one),
- the listening socket and the trigger (cheap, and the listener's ``readable`` runs waitress's
  idle-connection maintenance),
- and every connection once a second (what the maintenance marked to close, a missed change).

A connection is unregistered when it leaves the map, before its socket is closed (so a descriptor
number reused by the next connection never inherits its events); one that stopped being readable
since it was asked (the maintenance marked it to close) is not read on its event, as waitress's
loop would not have read it.

While a request is served, its task thread writes the answer and sends it itself (waitress's
``send_bytes`` is 1): between the append to the output buffer and the send's end (a system call,
the GIL let go) the connection looks writable, and waitress's loop, woken by every ready
``POLLOUT``, found nothing it could send (the task holds the buffer's lock) and woke again, turn
after turn, taking the GIL from the very thread it waited for: ~12 to 34 idle turns per request
(bench/RESULTS.md, "The sandbox's cycle"). Here a connection with a request in flight whose
``POLLOUT`` turn sent nothing is *muted*: asked without ``POLLOUT`` until the trigger is pulled,
which waitress does whenever a task needs the loop to send (its own send left data, it waits
below the high watermark, its request ended), or until the next full scan.
"""
from __future__ import annotations

import select
import time
from typing import Any

from waitress import wasyncore

READ = select.POLLIN | select.POLLPRI  # what poll2 asks for a readable dispatcher
FULL_SCAN_S = 1.0


class EpollMap(dict):
    """Waitress's socket map (descriptor -> dispatcher) that tells its loop what came and went."""

    def __init__(self) -> None:
        super().__init__()
        self.epoll = select.epoll()
        self.registered: dict[int, tuple[Any, int]] = {}  # fd -> (dispatcher, mask in the epoll set)
        self.touched: set[int] = set()
        self.muted: set[int] = set()  # connections whose task sends for them: no POLLOUT until the trigger

    def __setitem__(self, fd: int, obj: Any) -> None:
        super().__setitem__(fd, obj)
        self.touched.add(fd)

    def __delitem__(self, fd: int) -> None:
        super().__delitem__(fd)
        self.forget(fd)  # the socket is still open here: its own registration goes
        self.muted.discard(fd)

    def forget(self, fd: int) -> None:
        if self.registered.pop(fd, None) is not None:
            try:
                self.epoll.unregister(fd)
            except (OSError, ValueError):  # closed already (the descriptor, or the loop's epoll)
                pass

    def interest(self, fd: int) -> bool:
        """Ask the dispatcher at ``fd`` what it wants and update its registration; True when it is
        busy (anything but an idle connection waiting for its next request)."""
        obj = self.get(fd)
        if obj is None:
            self.forget(fd)
            return False
        mask = READ if obj.readable() else 0
        if obj.writable() and not obj.accepting:
            if fd not in self.muted or not getattr(obj, "requests", None):
                self.muted.discard(fd)
                mask |= select.POLLOUT
        held = self.registered.get(fd)
        if held is not None and held[0] is not obj:  # another dispatcher on a reused descriptor
            self.forget(fd)
            held = None
        if mask == 0:
            self.forget(fd)
        elif held is None:
            try:
                self.epoll.register(fd, mask)
            except OSError:  # closed under us: the map drops it soon
                return True
            self.registered[fd] = (obj, mask)
        elif held[1] != mask:
            try:
                self.epoll.modify(fd, mask)
            except OSError:  # closed under us: the map drops it soon
                self.registered.pop(fd, None)
                return True
            self.registered[fd] = (obj, mask)
        requests = getattr(obj, "requests", None)  # None: the listener or the trigger, asked every turn
        return mask != READ or requests is None or bool(requests)

    def close(self) -> None:
        self.epoll.close()


def loop(socket_map: EpollMap, timeout: float = 1.0) -> None:
    """Serve the map's dispatchers until it is empty (as ``wasyncore.loop``)."""
    busy: set[int] = set()
    evented: list[int] = []
    next_scan = 0.0
    try:
        while socket_map:
            now = time.monotonic()
            if now >= next_scan:
                next_scan = now + FULL_SCAN_S
                candidates = set(socket_map)
                socket_map.muted.clear()
            else:
                candidates = busy | set(evented)
            touched, socket_map.touched = socket_map.touched, set()
            candidates |= touched
            busy = {fd for fd in candidates if socket_map.interest(fd)}
            try:
                events = socket_map.epoll.poll(timeout)
            except InterruptedError:
                events = []
            evented = []
            for fd, flags in events:
                held = socket_map.registered.get(fd)
                if held is None or socket_map.get(fd) is not held[0]:
                    continue
                evented.append(fd)
                obj = held[0]
                if flags & READ and not obj.readable():  # e.g. marked to close since it was asked
                    flags &= ~READ  # (the idle maintenance runs in the listener's readable())
                if getattr(obj, "requests", None) is None:  # the trigger (or the listener): a task
                    socket_map.muted.clear()  # may need the loop to send for it
                pending = getattr(obj, "total_outbufs_len", 0) if flags & select.POLLOUT else 0
                if flags:
                    wasyncore.readwrite(obj, flags)
                if pending and obj.requests and obj.total_outbufs_len >= pending:  # sent nothing
                    socket_map.muted.add(fd)
    finally:
        socket_map.close()

