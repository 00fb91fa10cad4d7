"""``prorl-celery projects``: the operator's tenants and their API keys.

``add NAME [--weight W]`` creates the project (or, for an existing one, issues another key: a
rotation) and prints the new key once: only its hash is kept. ``list`` shows each project, its
weight, the ids of its live keys, its quotas and what it holds now (rollouts in a stage, the
sandboxes they may hold, jobs pending in fair share). ``revoke NAME`` revokes every key of a
project, ``revoke KEY`` (an id from ``list``, or the key itself) one key; the API refuses it from
the next request on.
``set NAME [--weight W] [--max-in-flight N] [--max-sandboxes N] [--max-llm-in-flight N]
[--tokens-per-hour N] [--over [QUOTA=]hold|429]`` changes its weight and quotas
(:mod:`prorl_celery.quotas`; -1 unsets a limit).
``sync FILE --keys-dir DIR`` makes the projects of a tenant file (TOML: a ``[projects.NAME]`` table
each, ``weight`` and the quotas optional: ``max_in_flight = 100``, ``over = {tokens_per_hour =
"429"}``) exist with those weights and quotas (one left out is left as it is; -1 removes it); a new project gets a key, written to
``DIR/NAME.key`` (0600, in a 0700 directory) for the operator to hand over. An existing project
keeps its keys (a revoked one stays revoked: ``add`` gives it a new key); no other project is
touched. The Slurm head runs it at every start (``PRORL_PROJECTS_FILE``).
They talk to Redis directly (``PRORL_REDIS_URL``, or the state directory's secrets file), like
``status``: the API's token is not needed, Redis's password is.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _projects():
    from prorl_celery.connections import get_redis
    from prorl_celery.projects import ProjectStore

    return ProjectStore(get_redis())


def _load(args: argparse.Namespace) -> None:
    from prorl_celery.ops.cli import _load_secrets

    _load_secrets(args.state_dir)


def _cmd_add(args: argparse.Namespace) -> int:
    from prorl_celery.errors import InvalidRequest

    _load(args)
    try:
        issued = _projects().add(args.name, args.weight)
    except InvalidRequest as exc:
        print(f"projects: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(issued.model_dump()))
    else:
        print(f"project {issued.project}: new key {issued.key_id} (shown once; send it as "
              f"'Authorization: Bearer <key>')", file=sys.stderr)
        print(issued.key)
    return 0


def _held(names: list[str]) -> list[dict[str, int]]:
    from prorl_celery.jobs import JobStore
    from prorl_celery.ops.report import holdings

    return holdings(JobStore(_projects().redis), names)


def _cmd_list(args: argparse.Namespace) -> int:
    _load(args)
    projects = _projects().list()
    held = _held([p.name for p in projects])
    if args.json:
        print(json.dumps([{**p.model_dump(), "now": now} for p, now in zip(projects, held)], indent=2))
        return 0
    print(f"{'project':<24} {'weight':>7}  {'created':<20} keys")
    for p, now in zip(projects, held):
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(p.created))
        print(f"{p.name:<24} {p.weight:>7g}  {created:<20} {', '.join(p.keys) or '- (all revoked)'}")
        limits = p.quotas.model_dump(exclude_none=True, exclude={"over"})
        if limits:
            print(" " * 26 + "quotas: " + ", ".join(f"{k}={v} ({p.quotas.over.get(k, 'hold')})"
                                                   for k, v in limits.items()))
        print(" " * 26 + f"now: {now['in_stages']} rollouts in a stage holding up to {now['sandboxes']} "
                         f"sandboxes, {now['pending']} pending")
    return 0


def _cmd_revoke(args: argparse.Namespace) -> int:
    from prorl_celery.errors import UnknownProject

    _load(args)
    try:
        revoked = _projects().revoke(args.target)
    except UnknownProject as exc:
        print(f"projects: {exc}", file=sys.stderr)
        return 1
    print(f"revoked {len(revoked)} key(s): {', '.join(revoked) or '-'}")
    return 0


def _cmd_set(args: argparse.Namespace) -> int:
    from prorl_celery.errors import InvalidRequest, UnknownProject
    from prorl_celery.quotas import QUOTA_NAMES

    _load(args)
    changes: dict = {name: getattr(args, name) for name in QUOTA_NAMES if getattr(args, name) is not None}
    over = {}
    for item in args.over or []:
        name, _, policy = item.rpartition("=")
        for quota in ([name] if name else QUOTA_NAMES):
            over[quota] = policy
    if over:
        changes["over"] = over
    try:
        if args.weight is not None:
            _projects().set_weight(args.name, args.weight)
        quotas = _projects().set_quotas(args.name, changes)
    except (InvalidRequest, UnknownProject) as exc:
        print(f"projects: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(quotas.model_dump(exclude_none=True)))
    return 0


def _cmd_sync(args: argparse.Namespace) -> int:
    import tomllib
    from pathlib import Path

    from prorl_celery.errors import InvalidRequest
    from prorl_celery.quotas import QUOTA_NAMES
    from prorl_celery.statedir import make_private_dir

    _load(args)
    with open(args.file, "rb") as fh:
        wanted = tomllib.load(fh).get("projects", {})
    if not isinstance(wanted, dict) or not all(isinstance(v, dict) for v in wanted.values()):
        print(f"projects: {args.file}: expected a [projects.NAME] table per project", file=sys.stderr)
        return 2
    store, keys_dir = _projects(), make_private_dir(Path(args.keys_dir))
    live = {p.name: p for p in store.list()}
    try:
        for name, table in sorted(wanted.items()):
            weight = table.get("weight")
            quotas = {k: v for k, v in table.items() if k in (*QUOTA_NAMES, "over")}
            if name in live:
                if weight is not None:
                    store.set_weight(name, weight)
                if quotas:
                    store.set_quotas(name, quotas)
                print(f"{name}: exists, {len(live[name].keys)} live key(s)")
                continue
            issued = store.add(name, weight)
            if quotas:
                store.set_quotas(name, quotas)
            path = keys_dir / f"{name}.key"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(issued.key + "\n")
            print(f"{name}: new key {issued.key_id} in {path}")
    except InvalidRequest as exc:
        print(f"projects: {args.file}: {exc}", file=sys.stderr)
        return 2
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    projects = sub.add_parser("projects", help="projects (tenants) and their API keys: add, list, revoke")
    verbs = projects.add_subparsers(dest="verb", required=True)
    state = {"default": os.environ.get("PRORL_STATE_DIR"),
             "help": "read PRORL_REDIS_URL from <state dir>/secrets.env unless set"}
    add = verbs.add_parser("add", help="create a project (or give it another key); prints the key once")
    add.add_argument("name", help="lower-case letters, digits, '_', '-', '.'")
    add.add_argument("--weight", type=float, default=None, help="its share when projects compete (default 1)")
    add.add_argument("--json", action="store_true", help="print {project, key_id, key} as JSON")
    add.add_argument("--state-dir", **state)
    add.set_defaults(func=_cmd_add)
    listing = verbs.add_parser("list", help="projects, weights and the ids of their live keys")
    listing.add_argument("--json", action="store_true")
    listing.add_argument("--state-dir", **state)
    listing.set_defaults(func=_cmd_list)
    revoke = verbs.add_parser("revoke", help="revoke a project's keys (NAME) or one key (its id or the key)")
    revoke.add_argument("target")
    revoke.add_argument("--state-dir", **state)
    revoke.set_defaults(func=_cmd_revoke)
    set_ = verbs.add_parser("set", help="change a project's weight and quotas (a limit of -1: none)")
    set_.add_argument("name")
    set_.add_argument("--weight", type=float, default=None, help="its share when projects compete")
    for flag, what in (("max-in-flight", "rollouts released to the stages at once"),
                       ("max-sandboxes", "rollouts in init, run or eval at once"),
                       ("max-llm-in-flight", "LLM requests in flight at once"),
                       ("tokens-per-hour", "prompt plus generated tokens in the last hour")):
        set_.add_argument(f"--{flag}", type=int, default=None, help=what)
    set_.add_argument("--over", action="append", metavar="[QUOTA=]hold|429",
                      help="what a submission meets at a quota: held, or refused 429 (no QUOTA: every quota)")
    set_.add_argument("--state-dir", **state)
    set_.set_defaults(func=_cmd_set)
    sync = verbs.add_parser("sync", help="make a tenant file's projects exist; new keys go to --keys-dir")
    sync.add_argument("file", help="TOML: [projects.NAME] tables, each with an optional weight and quotas")
    sync.add_argument("--keys-dir", required=True, help="where a new key is written, as NAME.key (0600)")
    sync.add_argument("--state-dir", **state)
    sync.set_defaults(func=_cmd_sync)
