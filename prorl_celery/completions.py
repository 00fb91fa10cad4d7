"""Finished jobs in completion order, from Redis streams written by the job store.

A cursor is a stream entry id; reading from a cursor returns what finished after it, so a
consumer that reconnects with its last cursor misses nothing and sees nothing twice.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

import redis

from prorl_celery import keys
from prorl_celery.jobs import JobStore
from prorl_celery.redisio import text
from prorl_celery.rollout.views import job_views
from prorl_celery.status import JobStatus

log = logging.getLogger(__name__)

BLOCK_SLICE_S = 10.0
START = "0-0"
LATEST = "latest"  # asks only for the cursor after everything finished so far


def read(store: JobStore, cursor: str | None, wait_s: float = 0.0, group_id: str | None = None,
         count: int = 500, project: str | None = None, linger_s: float = 0.0) -> tuple[list[dict[str, Any]], str]:
    """Up to ``count`` completions after ``cursor``, waiting up to ``wait_s`` for the first.

    Returns (completions, next cursor); each completion holds its own ``cursor`` and the job.
    The cursor ``latest`` returns no completions, only the cursor after the newest one.
    ``project``: only its jobs' completions (the cursor still moves past the others').
    ``linger_s``: once the first has come, wait that much longer (never past ``wait_s``) for
    more before answering, unless ``count`` came already: a consumer following a steady stream
    then makes one read per linger, not one per completion."""
    stream = keys.group_completions(group_id) if group_id else keys.completions()
    if cursor == LATEST:
        last = store.redis.xrevrange(stream, count=1)
        return [], text(last[0][0]) if last else START
    cursor = cursor or START
    deadline = time.monotonic() + wait_s
    while True:
        left = deadline - time.monotonic()
        # BLOCK 0 would wait forever; a slice stays well inside the connection's socket timeout
        block = max(1, round(min(left, BLOCK_SLICE_S) * 1000)) if left > 0 else None
        reply = store.redis.xread({stream: cursor}, count=count, block=block)
        entries = reply[0][1] if reply else []
        if entries:
            cursor = text(entries[-1][0])
        if project is not None:
            entries = [(i, fields) for i, fields in entries if text(fields.get(b"project", b"")) == project]
        if entries or block is None or time.monotonic() >= deadline:
            break
    if not entries:
        return [], cursor
    pause = min(linger_s, deadline - time.monotonic())
    if pause > 0 and len(entries) < count:
        time.sleep(pause)
        reply = store.redis.xread({stream: cursor}, count=count - len(entries))
        more = reply[0][1] if reply else []
        if more:
            cursor = text(more[-1][0])
        entries += [(i, fields) for i, fields in more
                    if project is None or text(fields.get(b"project", b"")) == project]
    views = job_views(store.shards, store.get_many([text(fields[b"job_id"]) for _, fields in entries], view=True))
    out = []
    for (entry_id, fields), view in zip(entries, views):
        item = {text(k): text(v) for k, v in fields.items()}
        item["group_id"] = item.get("group_id") or None
        item["project"] = item.get("project") or None
        item["cursor"] = text(entry_id)
        item["job"] = view.model_dump(mode="json") if view else None
        out.append(item)
    return out, cursor


def valid_cursor(cursor: str) -> bool:
    if cursor == LATEST:
        return True
    head, _, tail = cursor.partition("-")
    return head.isdigit() and (tail == "" or tail.isdigit())


class FinishWatcher:
    """Wakes the threads that wait for particular jobs to end.

    One reader thread per process follows the completion stream (every terminal transition
    writes to it) and wakes the waiters of each job it sees end, so a wait answers as soon as
    the job ends instead of at the next poll. A waiter still looks at the job's status every
    ``recheck_s`` in case the reader is cut off from Redis."""

    def __init__(self, store: JobStore, recheck_s: float = 1.0):
        self.store = store
        self.recheck_s = recheck_s
        self._waiters: dict[str, list[threading.Event]] = {}
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None

    def wait(self, job_id: str, timeout: float) -> JobStatus | None:
        """The job's status once it is terminal or ``timeout`` passed; None for an unknown job."""
        event = threading.Event()
        with self._lock:
            self._waiters.setdefault(job_id, []).append(event)
        try:
            self._ensure_reader()
            deadline = time.monotonic() + timeout
            while True:
                status = self.store.status(job_id)  # read after registering: no end is missed
                left = deadline - time.monotonic()
                if status is None or status.terminal or left <= 0:
                    return status
                event.wait(min(left, self.recheck_s))
        finally:
            with self._lock:
                waiting = self._waiters.get(job_id, [])
                waiting.remove(event)
                if not waiting:
                    self._waiters.pop(job_id, None)

    def _ensure_reader(self) -> None:
        """Start the reader from the stream's newest entry, before the first waiter looks at its job."""
        with self._lock:
            if self._reader is None or not self._reader.is_alive():
                last = self.store.redis.xrevrange(keys.completions(), count=1)
                self._reader = threading.Thread(target=self._follow, args=(text(last[0][0]) if last else START,),
                                                name="finish-watcher", daemon=True)
                self._reader.start()

    def _follow(self, cursor: str) -> None:
        while True:
            try:
                reply = self.store.redis.xread({keys.completions(): cursor}, count=1000,
                                               block=round(BLOCK_SLICE_S * 1000))
            except redis.RedisError as exc:
                log.warning("finish watcher lost Redis (%s); waiters fall back to polling", exc)
                time.sleep(1.0)
                continue
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    cursor = text(entry_id)
                    with self._lock:
                        waiting = list(self._waiters.get(text(fields.get(b"job_id", b"")), []))
                    for event in waiting:
                        event.set()
