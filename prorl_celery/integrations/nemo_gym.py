"""NeMo RL through NeMo Gym: Gym's ``prorl_agent`` agent server with this service's bearer token.

Gym's agent server (``responses_api_agents/prorl_agent``, NeMo Gym PR 1290) makes two client calls:
``initialize_prorl_server(prorl_url, model_endpoint)`` (``POST /start``, then ``POST /add_llm_server``
with its model server's ``http://host:port/v1``; the replacement here registers it in the
``nemo-gym`` chat dialect instead) and ``call_prorl_process(prorl_url, instance,
sampling_params, job_id, timeout_seconds)`` (``POST /process``). Neither sends an ``Authorization``
header, which this service requires on every route (unpatched, each gets a 401 whose message
names :func:`patch_prorl_agent`), and the first only prints a warning when a call fails, so a
refused registration shows up later as every rollout failing. Its ``job_id`` is the row's instance
id, the same for every sample of a group and at every step: ``/process`` takes it as a label and
runs a new rollout on every call.

:func:`patch_prorl_agent` replaces both in Gym's modules with the versions here, which send the
token (``PRORL_API_TOKEN`` by default) and raise on a refusal. Call it in the Gym agent server's
process before the server is built (e.g. at the top of ``responses_api_agents/prorl_agent/app.py``,
or from a ``sitecustomize`` on that server's ``PYTHONPATH``).
"""
from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

import requests

GYM_MODULES = ("responses_api_agents.prorl_agent.run_prorl", "responses_api_agents.prorl_agent.app")


def _headers(token: str | None) -> dict[str, str]:
    token = token or os.environ.get("PRORL_API_TOKEN")
    if not token:
        raise ValueError("no API token: pass token= or set PRORL_API_TOKEN")
    return {"Authorization": f"Bearer {token}"}


def initialize(prorl_url: str, model_endpoint: str, token: str | None = None) -> dict[str, Any]:
    """``POST /start`` (already running is fine), then the model server's registration; raises
    ``requests.HTTPError`` when either is refused. Returns the registration's answer.

    Gym's own call registers through ``/add_llm_server``, which takes only an address (the ``vllm``
    chat dialect); this one registers through ``POST /llm_servers`` in the ``nemo-gym`` dialect, so
    each turn's ids go back on its assistant message (NeMo RL's vLLM continues from them), with
    the probe asking for tool calls and exact ids (a model server without
    ``return_token_id_information`` is refused now, not found out from the trajectories)."""
    headers = _headers(token)
    started = requests.post(f"{prorl_url}/start", headers=headers, timeout=30)
    if started.status_code != 400:  # 400: already running, as in the reference system
        started.raise_for_status()
    added = requests.post(f"{prorl_url}/llm_servers", json={
        "address": model_endpoint, "protocol": "chat", "dialect": "nemo-gym", "tools": True, "exact_tokens": True},
        headers=headers, timeout=120)
    added.raise_for_status()
    return added.json()


def process(prorl_url: str, instance: dict[str, Any], sampling_params: dict[str, Any],
            job_id: str | None = None, timeout_seconds: float = 3600.0, token: str | None = None) -> dict[str, Any]:
    """One blocking ``POST /process``; raises ``requests.HTTPError`` on a non-2xx answer."""
    body: dict[str, Any] = {"instance": instance, "sampling_params": sampling_params}
    if job_id is not None:
        body["job_id"] = job_id
    resp = requests.post(f"{prorl_url}/process", json=body, headers=_headers(token), timeout=timeout_seconds)
    resp.raise_for_status()
    return resp.json()


async def process_async(prorl_url: str, instance: dict[str, Any], sampling_params: dict[str, Any],
                        job_id: str | None = None, timeout_seconds: float = 3600.0,
                        token: str | None = None) -> dict[str, Any]:
    """:func:`process` for Gym's event loop (the request runs in a thread; the loop is not blocked)."""
    return await asyncio.to_thread(process, prorl_url, instance, sampling_params, job_id, timeout_seconds, token)


def patch_prorl_agent(token: str | None = None, modules: tuple[str, ...] = GYM_MODULES) -> list[str]:
    """Point Gym's ``initialize_prorl_server`` and ``call_prorl_process`` at the token-carrying
    versions in each of ``modules`` (imported if needed; ``app`` imports them by name, so both
    modules are patched). Returns the modules patched."""
    _headers(token)  # fail now, not at the first rollout

    def initialize_prorl_server(prorl_url: str, model_endpoint: str) -> None:
        initialize(prorl_url, model_endpoint, token)

    async def call_prorl_process(prorl_url: str, instance: dict[str, Any], sampling_params: dict[str, Any],
                                 job_id: str | None = None, timeout_seconds: float = 3600.0) -> dict[str, Any]:
        return await process_async(prorl_url, instance, sampling_params, job_id, timeout_seconds, token)

    patched = []
    for name in modules:
        module = sys.modules.get(name) or __import__(name, fromlist=["_"])
        module.initialize_prorl_server = initialize_prorl_server
        module.call_prorl_process = call_prorl_process
        patched.append(name)
    return patched
