"""Where a session's calls go: the append-only rollout store (:mod:`prorl_celery.rollout.store`), the
same packed records the built-in agent's turns are, read back by the same path
(:mod:`prorl_celery.rollout.views`).

A :class:`CallLog` holds the session's :class:`~prorl_celery.rollout.transcript.Transcript`: a completed
call adds its packed record (its prompt kept as the ids past what the session's last call held)
and the conversation messages it brought, in memory, on the call's own thread, which wakes whoever
saves once its answer is written (:meth:`CallLog.wake`). Saving is never on a call's path, and
goes through the :class:`~prorl_celery.rollout.transcript.Sink` the built-in agent's loop saves
through: the run stage's loop flushes what came (fenced, with the job's state:
:meth:`tasks.context.StageContext.save`), or, outside a job, a writer thread appends it to the
store (:meth:`CallLog.to_store`, :class:`StoreSink`). Calls that complete together are saved in
one round trip."""
from __future__ import annotations

import logging
import threading
from typing import Any

from prorl_celery.llm.models import Turn
from prorl_celery.rollout.store import Call, RolloutStore
from prorl_celery.rollout.transcript import Sink, Transcript

log = logging.getLogger(__name__)
GATEWAY_META = "gateway"  # in a call's metadata: {"api", "continued", "gateway_s"}
RESENT = "resent"  # on a stored assistant message: the caller sent it again, no call of ours made it


class StoreSink:
    """A :class:`~prorl_celery.rollout.transcript.Sink` with no job: what ``transcript`` gained,
    appended to ``rollout_id``'s lists (no state, no fence: tests, the benchmark)."""

    def __init__(self, store: RolloutStore, rollout_id: str, transcript: Transcript):
        self.store, self.rollout_id, self.transcript = store, rollout_id, transcript

    def save(self) -> None:
        calls, messages = self.transcript.pending()
        self.store.append(self.rollout_id, calls, messages)
        self.transcript.mark_saved()


class CallLog:
    """The session's transcript and the ``sink`` that saves what it gained (and marks it saved:
    ``sink`` saves this ``transcript``). ``add`` is thread-safe; ``flush`` saves under the same lock."""

    def __init__(self, sink: Sink, transcript: Transcript | None = None):
        self.transcript = Transcript() if transcript is None else transcript
        self.sink = sink
        self.lock = threading.Lock()
        self.added = threading.Event()
        self._writer: threading.Thread | None = None
        self._closed = False

    @classmethod
    def to_store(cls, store: RolloutStore, rollout_id: str) -> CallLog:
        """A log whose writer thread appends to ``rollout_id``'s lists (no job, no fence: tests,
        the benchmark); :meth:`close` saves the rest and stops it."""
        transcript = Transcript()
        out = cls(StoreSink(store, rollout_id, transcript), transcript)
        out._writer = threading.Thread(target=out._write, name=f"gateway-log-{rollout_id}", daemon=True)
        out._writer.start()
        return out

    def add(self, turn: Turn, messages: list[dict[str, Any]], meta: dict[str, Any]) -> None:
        """Record one completed call: its turn (``meta`` beside the turn's own) and the messages
        the conversation gained (what it sent past the last call's, then its answer)."""
        with self.lock:
            self.transcript.add(turn, extra={GATEWAY_META: meta})
            self.transcript.messages.extend(messages)
        # whoever saves is woken by wake(), once the caller has its answer: a thread woken now
        # would take the GIL from the call it is part of

    def wait(self, timeout: float | None) -> bool:
        """Until woken (True: a call was answered, or close) or ``timeout`` passes (None: none)."""
        got = self.added.wait(timeout)
        self.added.clear()
        return got

    def wake(self) -> None:
        self.added.set()

    def flush(self) -> None:
        """Save what was added since the last save (nothing to do: no round trip)."""
        with self.lock:
            if self.transcript.has_pending():
                self.sink.save()

    def calls(self) -> list[Call]:
        """Every call recorded (saved or not), unpacked."""
        with self.lock:
            return [Call.unpack(blob) for blob in self.transcript.records]

    def close(self) -> None:
        """Stop the writer (if any) and save the rest."""
        self._closed = True
        self.wake()
        if self._writer is not None:
            self._writer.join(30)
        self.flush()

    def _write(self) -> None:
        while not self._closed:
            self.wait(None)  # woken by a call, or by close()
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - the next flush tries again; close() raises
                log.exception("gateway log: saving calls failed")
