"""The fake server's pause and resume endpoints, with the real servers' semantics (test and demo
tool; see :mod:`prorl_celery.fakes.llm.server`). Read from their code:

vLLM (0.32; its RL routes are mounted only with ``VLLM_SERVER_DEV_MODE=1``):

- ``POST /pause?mode=abort|wait|keep&clear_cache=true`` -> ``{"status": "paused"}``. ``abort``
  (the default) ends every request in flight at once: each answers with the tokens generated so
  far and ``finish_reason`` ``"abort"``; ``wait`` returns once the requests in flight finished;
  ``keep`` freezes them in the scheduler where they stand (``clear_cache`` is ignored then), and
  they go on after ``/resume``. In every mode, requests that arrive while paused wait in the
  queue (they are not refused). A mode outside the three is refused (FastAPI's 422).
- ``POST /resume`` -> ``{"status": "resumed"}``; ``GET /is_paused`` -> ``{"is_paused": bool}``.
- ``POST /update_weight_version {"new_version"}`` -> ``{"success": true, "new_version"}``, and
  ``GET /weight_info`` -> ``{"weight_version"}``: the version ``/inference/v1/generate`` reports
  per span of the output (``weight_versions``), so a request frozen across an update says which
  of its tokens came from which weights.

SGLang (``http_server.py``): ``POST /pause_generation {"mode": "abort"|"retract"|"in_place"}``
(``in_place``: requests stay in the running batch with their KV cache; ``retract``: back to the
waiting queue, the cache recomputed on continue; both continue after ``POST
/continue_generation``), ``POST /update_weight_version {"new_version", "abort_all_requests"}``;
an aborted request answers ``meta_info.finish_reason = {"type": "abort", ...}`` with its tokens so far.

llama.cpp has no pause: with ``--flavor llama.cpp`` these routes answer 404, as its server does.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from prorl_celery.fakes.llm.wire import HTTPError

if TYPE_CHECKING:
    from prorl_celery.fakes.llm.state import FakeLLM

VLLM_MODES = ("abort", "wait", "keep")
SGLANG_MODES = {"abort": "abort", "retract": "keep", "in_place": "keep"}
POST_ROUTES = ("/pause", "/resume", "/pause_generation", "/continue_generation", "/update_weight_version")
GET_ROUTES = ("/is_paused", "/weight_info")


def _pause(fake: FakeLLM, mode: str) -> dict[str, Any]:
    started = time.monotonic()
    counts = fake.engine.pause(mode)
    fake.pauses.append({"mode": mode, "t": time.time(), "server_s": time.monotonic() - started, **counts})
    return counts


def handle_post(fake: FakeLLM, path: str, query: dict[str, list[str]], body: dict[str, Any]) -> dict[str, Any]:
    if fake.options.flavor == "llama.cpp":
        raise HTTPError(404, "File Not Found", "not_found_error")
    if path == "/pause":
        mode = (query.get("mode") or ["abort"])[0]
        if mode not in VLLM_MODES:
            raise HTTPError(422, f"mode: Input should be 'abort', 'wait' or 'keep' (got {mode!r})",
                            "ValidationError", {"detail": [{"loc": ["query", "mode"], "msg":
                                                            "Input should be 'abort', 'wait' or 'keep'"}]})
        _pause(fake, mode)
        return {"status": "paused"}
    if path == "/pause_generation":
        mode = body.get("mode", "abort")
        if mode not in SGLANG_MODES:
            raise HTTPError(400, f"Invalid mode: {mode!r}. Expected one of {list(SGLANG_MODES)}.", "ValueError")
        _pause(fake, SGLANG_MODES[mode])
        return {"status": "ok", "message": "Generation paused."}
    if path in ("/resume", "/continue_generation"):
        fake.engine.resume()
        if fake.pauses and "frozen_s" not in fake.pauses[-1]:  # how long generation stood still
            fake.pauses[-1]["frozen_s"] = time.time() - fake.pauses[-1]["t"]
        return {"status": "resumed"} if path == "/resume" else {"status": "ok", "message": "Generation continued."}
    if path == "/update_weight_version":
        version = body.get("new_version")
        if not isinstance(version, str) or not version:
            raise HTTPError(422, "new_version: a non-empty string is required", "ValidationError")
        if body.get("abort_all_requests"):
            fake.engine.pause("abort")
            fake.engine.resume()
        fake.engine.set_version(version)
        return {"success": True, "new_version": version}
    raise HTTPError(404, f"no route {path}", "NotFoundError")


def handle_get(fake: FakeLLM, path: str) -> dict[str, Any]:
    if fake.options.flavor == "llama.cpp":
        raise HTTPError(404, "File Not Found", "not_found_error")
    if path == "/is_paused":
        return {"is_paused": fake.engine.paused is not None}
    return {"weight_version": fake.engine.version}
