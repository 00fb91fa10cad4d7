"""Finished jobs in completion order, from Redis streams written by the job store.

A cursor is a stream entry id; reading from a cursor returns what finished after it, so a
consumer that reconnects with its last cursor misses nothing and sees nothing twice.
"""
from __future__ import annotations

import time
from typing import Any

from prorl_celery import keys
from prorl_celery.jobs import JobStore

BLOCK_SLICE_S = 10.0
START = "0-0"
LATEST = "latest"  # asks only for the cursor after everything finished so far


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def read(store: JobStore, cursor: str | None, wait_s: float = 0.0, group_id: str | None = None,
         count: int = 500) -> tuple[list[dict[str, Any]], str]:
    """Up to ``count`` completions after ``cursor``, waiting up to ``wait_s`` for the first.

    Returns (completions, next cursor); each completion holds its own ``cursor`` and the job.
    The cursor ``latest`` returns no completions, only the cursor after the newest one."""
    stream = keys.group_completions(group_id) if group_id else keys.completions()
    if cursor == LATEST:
        last = store.redis.xrevrange(stream, count=1)
        return [], _text(last[0][0]) if last else START
    cursor = cursor or START
    deadline = time.monotonic() + wait_s
    while True:
        left = deadline - time.monotonic()
        # BLOCK 0 would wait forever; a slice stays well inside the connection's socket timeout
        block = max(1, round(min(left, BLOCK_SLICE_S) * 1000)) if left > 0 else None
        reply = store.redis.xread({stream: cursor}, count=count, block=block)
        entries = reply[0][1] if reply else []
        if entries or block is None or time.monotonic() >= deadline:
            break
    if not entries:
        return [], cursor
    records = store.get_many([_text(fields[b"job_id"]) for _, fields in entries])
    out = []
    for (entry_id, fields), record in zip(entries, records):
        item = {_text(k): _text(v) for k, v in fields.items()}
        item["group_id"] = item.get("group_id") or None
        item["cursor"] = _text(entry_id)
        item["job"] = record.view().model_dump(mode="json") if record else None
        out.append(item)
    return out, out[-1]["cursor"]


def valid_cursor(cursor: str) -> bool:
    if cursor == LATEST:
        return True
    head, _, tail = cursor.partition("-")
    return head.isdigit() and (tail == "" or tail.isdigit())
