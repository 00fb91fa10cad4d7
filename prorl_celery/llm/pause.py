"""A server's own pause and resume around a weight update, per the API its backend declares
(``pause_api``), and which mode a backend can honour.

- ``vllm``: ``POST /pause?mode=keep|abort|wait`` and ``POST /resume`` (vLLM's RL routes, mounted
  with ``VLLM_SERVER_DEV_MODE=1``), ``POST /update_weight_version {"new_version"}``;
- ``sglang``: ``POST /pause_generation {"mode": "in_place"|"abort"}``, ``POST /continue_generation``,
  ``POST /update_weight_version {"new_version"}``;
- ``none`` (llama.cpp, any server without them): the service's own abort where the backend's
  answers are streamed (llama.cpp's token API: the service cuts the stream and keeps the tokens
  that came), else only the service's own drain.

Mode fallback: ``keep`` needs the server's pause and answers that say which tokens each version
sampled (``weight_versions`` spans: vLLM's ``/inference/v1/generate``, the fake's token API), else
a frozen turn's tokens could not be told apart; ``abort`` (abort-and-continue) needs a token-mode
backend (the turn goes on from its ids) and either the server's pause or a streamed answer; else
``drain``.
"""
from __future__ import annotations

import time
from typing import Literal

from prorl_celery import http
from prorl_celery.errors import BackendFailed
from prorl_celery.llm import dialects
from prorl_celery.llm.models import Backend, PauseApi, Protocol

Mode = Literal["keep", "abort", "drain"]
TIMEOUT_S = 120.0


def effective_mode(backend: Backend, asked: Mode) -> Mode:
    """What ``backend`` can do of ``asked`` (keep > abort-and-continue > drain)."""
    api = backend.pause_api or PauseApi.NONE
    if asked == "drain" or backend.protocol is not Protocol.GENERATE:
        return "drain"
    wire = dialects.token_of(backend.dialect)  # what its dialect declares (None: no token API)
    if api is PauseApi.NONE:  # read streamed: the service can cut a turn and keep its tokens
        return "abort" if getattr(wire, "streamed", False) else "drain"
    if asked == "keep" and getattr(wire, "versioned_spans", False):  # spans say which version sampled what
        return "keep"
    return "abort"


def _post(address: str, path: str, body: dict | None, api_key: str | None) -> None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        status, data = http.request_json("POST", address + path, body if body is not None else {},
                                         headers=headers, timeout=TIMEOUT_S)
    except OSError as exc:
        raise BackendFailed(f"{address}{path}: {type(exc).__name__}: {exc}") from None
    if status != 200:
        raise BackendFailed(f"{address}{path} -> {status}: {str(data)[:300]}")


def pause_server(backend: Backend, mode: Mode, api_key: str | None = None) -> float:
    """Pause the server in ``mode`` (keep or abort); returns the seconds its call took."""
    started = time.monotonic()
    if backend.pause_api is PauseApi.VLLM:
        _post(backend.address, f"/pause?mode={mode}&clear_cache=false", None, api_key)
    elif backend.pause_api is PauseApi.SGLANG:
        _post(backend.address, "/pause_generation", {"mode": "in_place" if mode == "keep" else "abort"}, api_key)
    else:
        raise BackendFailed(f"backend {backend.id} declares no pause API")
    return time.monotonic() - started


def name_version(backend: Backend, version: str, api_key: str | None = None) -> None:
    """Tell the server the name of the weights it serves: the spans it answers then use the
    service's names (a server keeps its last name across registrations)."""
    _post(backend.address, "/update_weight_version", {"new_version": version}, api_key)


def resume_server(backend: Backend, version: str | None, api_key: str | None = None) -> None:
    """Name the new weights (the spans of frozen turns say which tokens came after) and resume."""
    if version is not None:
        name_version(backend, version, api_key)
    _post(backend.address, "/resume" if backend.pause_api is PauseApi.VLLM else "/continue_generation", None, api_key)
