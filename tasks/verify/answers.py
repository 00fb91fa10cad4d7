"""Final answers: where to find them in a reply, and whether they match the reference.

Equivalent forms (``0.5``, ``1/2``, ``\\frac{1}{2}``) are matched with ``math-verify``.
"""
from __future__ import annotations

import multiprocessing
import re
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout

_ALONE = re.compile(r"^\s*\(?([A-Ja-j])\)?[.)]?\s*$")
_STATED = re.compile(r"answer\s*(?:is|:)\s*\(?([A-J])\b", re.I)
_PAREN = re.compile(r"\(([A-J])\)")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, out = 1, []
    while i < len(text):
        ch = text[i]
        depth += ch == "{"
        depth -= ch == "}"
        if depth == 0:
            return "".join(out).strip()
        out.append(ch)
        i += 1
    return None


def _as_math(text: str) -> str:
    text = text.strip()
    return text if text.startswith("$") or "\\boxed" in text else f"${text}$"


def _verify(given: str, reference: str) -> bool:
    from math_verify import parse, verify

    try:
        gold = parse(_as_math(reference))
        answer = parse(_as_math(given))
        return bool(gold) and bool(answer) and bool(verify(gold, answer))
    except Exception:  # noqa: BLE001 - a parser failure is a wrong answer, not a crash
        return given.strip() == reference.strip()


_pool: ProcessPoolExecutor | None = None
_pool_lock = threading.Lock()


def _verifier() -> ProcessPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn"))
        return _pool


def _reset_verifier(pool: ProcessPoolExecutor) -> None:
    global _pool
    with _pool_lock:
        if _pool is pool:
            _pool = None
    for process in list(getattr(pool, "_processes", {}).values()):
        process.kill()
    pool.shutdown(wait=False, cancel_futures=True)


def math_equal(given: str | None, reference: str, timeout_s: float = 20.0) -> bool:
    """True when ``given`` and ``reference`` are the same mathematical answer.

    math-verify bounds its own work with SIGALRM, which only works in a main thread; off the
    main thread (a Celery thread-pool worker) the check runs in a small process pool instead,
    and a check that hangs past ``timeout_s`` counts as wrong."""
    if given is None or not given.strip():
        return False
    if threading.current_thread() is threading.main_thread():
        return _verify(given, str(reference))
    pool = _verifier()
    try:
        return pool.submit(_verify, given, str(reference)).result(timeout=timeout_s)
    except FuturesTimeout:
        _reset_verifier(pool)
        return False


def choice_letter(text: str | None, letters: str = "ABCDEFGHIJ") -> str | None:
    """The multiple-choice letter an answer names (``"B"``, ``"(b)"``, ``"The answer is C"``)."""
    if not text:
        return None
    text = last_boxed(text) or text
    for pattern in (_ALONE, _STATED, _PAREN):
        found = [m.group(1).upper() for m in pattern.finditer(text) if m.group(1).upper() in letters]
        if found:
            return found[-1]
    return None
