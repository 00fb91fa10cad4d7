#!/usr/bin/env python3
"""Helpers for the Slurm scripts: waiting for Redis / HTTP / the head's address file, writing that
file, and registering LLM servers with the API.

Standard library only, so that it runs with any ``python3`` (GPU nodes that host vLLM or SGLang need
not have prorl-celery installed); the address file's code is ``head_file.py`` beside it. Every
command exits 0 on success and 1 with a message on stderr otherwise.

    prorl_slurm.py secret
    prorl_slurm.py free-port
    prorl_slurm.py wait-redis URL [--timeout S]
    prorl_slurm.py wait-http URL [--timeout S] [--token T] [--any-status]
    prorl_slurm.py write-env FILE KEY=VALUE ...
    prorl_slurm.py get FILE KEY                            # one value of such a file
    prorl_slurm.py wait-head FILE [--timeout S]          # prints the file's KEY=VALUE lines
    prorl_slurm.py head-alive FILE JOB_ID                  # the file still names a running head
    prorl_slurm.py register [--head-file F | --api URL --token T] [--capacity N] [--protocol P]
                            [--model M] [--weight-version V] [--wait-llm S] [--timeout S] URL ...
    prorl_slurm.py deregister [--head-file F | --api URL --token T] ID ...
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import socket
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import NoReturn

from head_file import head_ready, job_running, read_env, redis_ping, write_env

POLL_S = 0.5


def log(message: str) -> None:
    print(f"prorl_slurm: {message}", file=sys.stderr, flush=True)


def fail(message: str) -> NoReturn:
    log(message)
    raise SystemExit(1)


# -- small pieces ---------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def http(method: str, url: str, body: dict | None = None, token: str | None = None,
         timeout: float = 10.0) -> tuple[int, str]:
    """(status, text); status 0 when nothing answered."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        request.add_header("Content-Type", "application/json")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except (OSError, ValueError):
        return 0, ""


def wait_until(predicate, timeout: float, what: str):
    """Poll ``predicate`` until it returns something true; timeout <= 0 waits forever."""
    deadline = time.monotonic() + timeout if timeout > 0 else None
    while True:
        value = predicate()
        if value:
            return value
        if deadline is not None and time.monotonic() > deadline:
            fail(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(POLL_S)


# -- LLM server registration ----------------------------------------------------------------------
def api_endpoint(args) -> tuple[str, str | None]:
    if args.api:
        return args.api.rstrip("/"), args.token
    if not args.head_file:
        fail("give --api URL (and --token) or --head-file FILE")
    log(f"waiting for the head's address file {args.head_file}")
    values = wait_until(lambda: head_ready(args.head_file), args.timeout, f"the head ({args.head_file})")
    return values["PRORL_API_URL"].rstrip("/"), args.token or values.get("PRORL_API_TOKEN") or None


def wait_api(api: str, token: str | None, timeout: float) -> None:
    log(f"waiting for the API at {api}")
    wait_until(lambda: http("GET", f"{api}/healthz", token=token, timeout=5)[0] == 200,
               timeout, f"the API at {api}/healthz")


def cmd_register(args) -> int:
    api, token = api_endpoint(args)
    wait_api(api, token, args.timeout)
    failed = 0
    for address in args.addresses:
        address = address.rstrip("/")
        if args.wait_llm != 0:
            # Any HTTP answer means the server listens; a model still loading answers 503 on vLLM.
            base = address.removesuffix("/v1")
            log(f"waiting for the LLM server {address}")
            wait_until(lambda: http("GET", f"{base}/v1/models", timeout=5)[0] in range(200, 500),
                       args.wait_llm, f"the LLM server {address}")
        body = {"address": address}
        for key in ("capacity", "protocol", "model", "weight_version"):
            if getattr(args, key) is not None:
                body[key] = getattr(args, key)
        status, text = http("POST", f"{api}/llm_servers", body, token)
        if status == 404 and set(body) == {"address"}:  # an API without /llm_servers: the drop-in
            status, text = http("POST", f"{api}/add_llm_server", body, token)
        try:
            backend_id = json.loads(text).get("id", "?")
        except ValueError:
            backend_id = "?"
        if status in (200, 201):
            log(f"registered {address} as {backend_id} ({'new' if status == 201 else 'known'})")
            print(f"{backend_id} {address}", flush=True)
        else:
            log(f"registering {address} failed: " + (f"HTTP {status} {text.strip()[:500]}" if status
                                                      else f"no answer from {api}"))
            failed += 1
    return 1 if failed else 0


def cmd_deregister(args) -> int:
    api, token = api_endpoint(args)
    failed = 0
    for backend_id in args.ids:
        status, text = http("DELETE", f"{api}/llm_servers/{urllib.parse.quote(backend_id)}",
                            token=token)
        if status in (200, 404):
            log(f"removed {backend_id}" if status == 200 else f"{backend_id} was not registered")
        else:
            log(f"removing {backend_id} failed: " + (f"HTTP {status} {text.strip()[:500]}" if status
                                                      else f"no answer from {api}"))
            failed += 1
    return 1 if failed else 0


# -- command line ---------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prorl_slurm.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("secret")
    sub.add_parser("free-port")
    p = sub.add_parser("wait-redis")
    p.add_argument("url")
    p.add_argument("--timeout", type=float, default=60)
    p = sub.add_parser("wait-http")
    p.add_argument("url")
    p.add_argument("--timeout", type=float, default=60)
    p.add_argument("--token", default=None)
    p.add_argument("--any-status", action="store_true", help="any HTTP answer will do, not only 200")
    p = sub.add_parser("write-env")
    p.add_argument("file")
    p.add_argument("pairs", nargs="+", metavar="KEY=VALUE")
    p = sub.add_parser("get")
    p.add_argument("file")
    p.add_argument("key")
    p = sub.add_parser("wait-head")
    p.add_argument("file")
    p.add_argument("--timeout", type=float, default=0, help="seconds; 0: forever")
    p = sub.add_parser("head-alive")
    p.add_argument("file")
    p.add_argument("job_id")
    for name in ("register", "deregister"):
        p = sub.add_parser(name)
        p.add_argument("--head-file", default=os.environ.get("PRORL_HEAD_FILE"))
        p.add_argument("--api", default=os.environ.get("PRORL_API_URL"))
        p.add_argument("--token", default=os.environ.get("PRORL_API_TOKEN"))
        p.add_argument("--timeout", type=float, default=600,
                       help="seconds to wait for the head and its API; 0: forever")
        if name == "register":
            p.add_argument("--capacity", type=int, default=None)
            p.add_argument("--protocol", default=None, help="chat (default) or generate")
            p.add_argument("--model", default=None)
            p.add_argument("--weight-version", default=None)
            p.add_argument("--wait-llm", type=float, default=1800,
                           help="seconds to wait for each server to answer (0: do not wait; "
                                "negative: forever)")
            p.add_argument("addresses", nargs="+", metavar="URL")
        else:
            p.add_argument("ids", nargs="+", metavar="ID")
    args = parser.parse_args(argv)

    if args.command == "secret":
        print(secrets.token_urlsafe(24))
    elif args.command == "free-port":
        print(free_port())
    elif args.command == "wait-redis":
        wait_until(lambda: redis_ping(args.url), args.timeout, "Redis")
    elif args.command == "wait-http":
        ok = (lambda s: s > 0) if args.any_status else (lambda s: s == 200)
        wait_until(lambda: ok(http("GET", args.url, token=args.token, timeout=5)[0]),
                   args.timeout, args.url)
    elif args.command == "write-env":
        pairs = dict(pair.partition("=")[::2] for pair in args.pairs)
        write_env(args.file, pairs)
    elif args.command == "get":
        try:
            value = read_env(args.file).get(args.key)
        except (OSError, ValueError):
            value = None
        if value is None:
            return 1
        print(value)
    elif args.command == "wait-head":
        values = wait_until(lambda: head_ready(args.file), args.timeout, f"the head ({args.file})")
        for key, value in values.items():
            print(f"{key}={shlex.quote(value)}")
    elif args.command == "head-alive":
        try:
            values = read_env(args.file)
        except OSError:
            return 1
        if values.get("PRORL_HEAD_JOB_ID", "") != args.job_id:
            return 1
        return 0 if job_running(args.job_id) is not False else 1
    elif args.command == "register":
        if args.wait_llm < 0:
            args.wait_llm = -1  # wait_until: <= 0 is forever, and 0 here means "do not wait"
        return cmd_register(args)
    elif args.command == "deregister":
        return cmd_deregister(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
