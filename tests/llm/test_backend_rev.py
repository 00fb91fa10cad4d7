"""A backend's record and its revision: every writer of the hash gives it a new revision, the
router's counters do not, no code writes the hash another way, and a process that keeps a copy of
the record sees each change at its next acquire (prorl_celery/llm/registry.py, routing.py)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from prorl_celery import keys
from prorl_celery.llm import BackendSpec, BackendStatus, control, counts, health, registry as registry_module, routing
from prorl_celery.llm.registry import COUNTERS, REV
from prorl_celery.llm.routing import Router

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ["prorl_celery", "flask_api", "tasks", "sandboxes", "config", "bench", "examples", "scripts", "slurm_scripts"]
SUFFIXES = {".py", ".sh", ".sbatch", ".lua"}

# Every line of the code that names a backend's hash (keys.llm_backend), and what it does there: a
# new line fails this test until it is added here, a writer only through the registry's scripts.
NAMED = {
    ("prorl_celery/llm/registry.py", "created = self.redis.eval(_ADD, 4, keys.llm_backends(), keys.llm_backend(bid),"):
        "write: _ADD (new revision)",
    ("prorl_celery/llm/registry.py", "pipe.delete(keys.llm_backend(bid), keys.llm_inflight(bid), keys.llm_sessions(bid))"):
        "remove: the hash is gone and the id leaves the set the acquire reads",
    ("prorl_celery/llm/registry.py", "pipe.hgetall(keys.llm_backend(bid))"): "read",
    ("prorl_celery/llm/registry.py", "return int(self.redis.eval(_WRITE, 1, keys.llm_backend(bid), new_rev(), json.dumps(plan)))"):
        "write: _WRITE (new revision)",
    ("prorl_celery/llm/registry.py", 'raw = self.redis.hget(keys.llm_backend(bid), "api_key")'): "read",
    ("prorl_celery/llm/routing.py", 'names = {"$BACKEND": keys.llm_backend(""), "$INFLIGHT": keys.llm_inflight(""),'):
        "the acquire's prefix, written into its text: it reads (asserted below)",
    ("prorl_celery/llm/counts.py", "_COUNTS_SCRIPT(client, [keys.llm_backend(bid) for bid in ids], [v for bid in ids for v in tallies[bid].argv()])"):
        "the router's counters: those only (asserted below)",
    ("prorl_celery/llm/control.py", 'raw = registry.redis.hget(keys.llm_backend(backend.id), "paused_until")'): "read",
    ("prorl_celery/llm/health.py", 'probed_at = float(client.hget(keys.llm_backend(backend.id), "probed_at") or 0)'): "read",
    ("prorl_celery/llm/health.py", 'api_key = registry.redis.hget(keys.llm_backend(backend.id), "api_key")'): "read",
    ("prorl_celery/ops/report.py",
     "record = {text(k): text(v) for k, v in routing.hgetall(keys.llm_backend(backend_id)).items()}"): "read",
}
HASH_WRITES = re.compile(r"redis\.call\('(HSET|HDEL|HINCRBY|HINCRBYFLOAT|HSETNX|HMSET)'")


def _arguments(script: str, command: str, key: str) -> list[str]:
    """The argument text of each ``redis.call('<command>', <key>, ...)`` in ``script``."""
    found = []
    for match in re.finditer(re.escape(f"redis.call('{command}', {key},"), script):
        depth, at = 1, match.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(script[at], 0)
            at += 1
        found.append(script[match.end():at - 1])
    return found


def _named_lines() -> set[tuple[str, str]]:
    found = set()
    for top in SOURCES:
        for path in (ROOT / top).rglob("*"):
            if path.suffix not in SUFFIXES or not path.is_file():
                continue
            for line in path.read_text(errors="replace").splitlines():
                if "llm_backend(" in line or "llm:backend:" in line:
                    found.add((str(path.relative_to(ROOT)), line.strip()))
    return found


@pytest.mark.unit
def test_no_code_names_a_backends_hash_but_the_known_readers_and_writers():
    found = _named_lines()
    found.discard(("prorl_celery/keys.py", "def llm_backend(backend_id: str) -> str:"))
    found.discard(("prorl_celery/keys.py", 'return f"{PREFIX}:llm:backend:{backend_id}"'))
    assert found == set(NAMED), "a new use of a backend's hash: writes go through BackendRegistry.write"


@pytest.mark.unit
def test_the_scripts_that_write_a_backend_hash_give_it_a_new_revision_or_write_counters_only():
    scripts = {name: value for module in (registry_module, routing, counts, control, health)
               for name, value in vars(module).items() if isinstance(value, str) and "redis.call(" in value}
    writing = {name for name, text in scripts.items() if HASH_WRITES.search(text)}
    # _END writes sets and strings only; _ACQUIRE_TEXT is _ACQUIRE with its prefixes written in
    assert writing == {"_ADD", "_WRITE", "_COUNTS", "_ACQUIRE", "_ACQUIRE_TEXT"}
    for name in ("_ADD", "_WRITE"):
        assert "redis.call('HSET', KEYS[2], 'rev', ARGV[5])" in scripts[name] or \
            "if wrote then redis.call('HSET', KEYS[1], 'rev', ARGV[1]) end" in scripts[name]
    release = scripts["_COUNTS"]  # (KEYS: the backends' hashes, each ``key`` in turn)
    assert set(re.findall(r"redis\.call\('(\w+)', (?:KEYS|key)\b", release)) == {"HMGET", "HSET"}
    written = {name for args in _arguments(release, "HSET", "key") for name in re.findall(r"'([a-z_]+)'", args)}
    assert written == set(COUNTERS)  # the router writes its counters, which no process copies
    acquire = scripts["_ACQUIRE"]  # writes one hash: the project's tokens of the hour (its kept sum, lapsed minutes)
    assert {m.group(2) for m in re.finditer(HASH_WRITES.pattern + r", (\w+)", acquire)} == {"tk"}
    assert "local minute, tk = math.floor(tonumber(now) / 60000), $TOKENS .. mine" in acquire


def _state(pool, bid: str) -> tuple[dict, str | None]:
    raw = {k.decode(): v.decode() for k, v in pool.registry.redis.hgetall(keys.llm_backend(bid)).items()}
    return {k: v for k, v in raw.items() if k not in (*COUNTERS, REV)}, raw.get(REV)


@pytest.mark.unit
def test_every_writer_gives_a_new_revision_and_a_release_none(pool, monkeypatch):
    reg, address = pool.registry, "http://10.0.0.6:1"
    monkeypatch.setattr(health, "probe", lambda *args, **kwargs: None)  # the server answers its probe
    bid = reg.add(BackendSpec(address=address, capacity=4, weight_version="v0", probe=False))[0].id
    slot = pool.router.acquire("job-rev")
    pool.router.release(slot, "ok")
    writers = [
        ("registration again", lambda: reg.add(BackendSpec(address=address, model="m2", probe=False))),
        ("set_status", lambda: reg.set_status(bid, BackendStatus.DRAINING, [BackendStatus.ACTIVE])),
        ("reactivate", lambda: reg.reactivate(bid, "v1", [BackendStatus.DRAINING])),
        ("set_fields", lambda: reg.set_fields(bid, last_error="x")),
        ("clear_fields", lambda: reg.clear_fields(bid, "last_error")),
        ("drain", lambda: control.drain(reg, [bid], wait_s=0)),
        ("resume with a weight version", lambda: control.resume(reg, [bid], weight_version="v2")),
        ("pause", lambda: control.pause(reg, [bid], "drain", wait_s=0, max_pause_s=0.01)),
        ("the pause expired", lambda: control.expire_pauses(reg, now=2e9)),
        ("quarantine", lambda: health.quarantine(reg, bid, "boom")),
        ("a probe that answers", lambda: health.probe_quarantined(pool.redis, min_interval_s=0)),
        ("pause again", lambda: control.pause(reg, [bid], "drain", wait_s=0)),
        ("the claim of a pause's expiry",
         lambda: reg.claim_pause_expiry(bid, reg.redis.hget(keys.llm_backend(bid), "paused_until"))),
    ]
    for what, write in writers:
        before, rev_before = _state(pool, bid)
        write()
        after, rev_after = _state(pool, bid)
        assert after != before, f"{what} changed nothing: the check below would prove nothing"
        assert rev_after and rev_after != rev_before, what
    # no write, no new revision: a status move from a state it is not in, a guard that fails
    fields, rev = _state(pool, bid)
    assert not reg.set_status(bid, BackendStatus.ACTIVE, [BackendStatus.QUARANTINED])
    assert not reg.claim_pause_expiry(bid, b"1")
    assert _state(pool, bid) == (fields, rev)
    # the router's counters: written for every release, outside the revision
    reg.set_status(bid, BackendStatus.ACTIVE, [BackendStatus.DRAINING])
    fields, rev = _state(pool, bid)
    pool.router.flush_counts()  # the first release's (else written within counts.FLUSH_S)
    counts = reg.get(bid)
    for outcome in ("ok", "failed", "ok"):
        pool.router.release(pool.router.acquire("job-rev"), outcome)
    pool.router.flush_counts()
    assert _state(pool, bid) == (fields, rev)
    after = reg.get(bid)
    assert (after.served, after.failures) == (counts.served + 2, counts.failures + 1)
    # a write to a backend not registered writes nothing (no stray hash)
    reg.remove(bid)
    reg.set_fields(bid, last_error="late")
    assert not reg.redis.exists(keys.llm_backend(bid))


@pytest.mark.unit
def test_a_slot_is_this_process_copy_while_its_revision_holds(pool):
    spec = BackendSpec(address="http://10.0.0.7:1", capacity=3, model="m", weight_version="v7", api_key="k",
                       probe=False)
    bid = pool.registry.add(spec)[0].id
    router = Router(pool.redis)
    first = router.acquire("job-copy")
    router.release(first, "ok")
    read = router.records_read
    second = router.acquire("job-copy")
    assert router.records_read == read  # the reply named the revision this process holds: no record
    assert second.backend.model_dump(exclude={"in_flight"}) == first.backend.model_dump(exclude={"in_flight"})
    assert second.api_key == "k" and second.backend.in_flight == 1
    registry_view = pool.registry.get(bid).model_dump(exclude={"served", "failures", "consecutive_failures"})
    assert second.backend.model_dump(exclude={"served", "failures", "consecutive_failures"}) == registry_view
    router.release(second, "aborted")
    # a record written before revisions were (no rev field) is sent with every acquire, never kept
    pool.registry.redis.hdel(keys.llm_backend(bid), REV)
    for _ in range(2):
        router.release(router.acquire("job-copy"), "aborted")
    assert router.records_read == read + 2


WRITER = textwrap.dedent("""
    import json, sys
    from prorl_celery.connections import get_redis
    from prorl_celery.llm import BackendSpec, BackendStatus, control, health
    from prorl_celery.llm.registry import BackendRegistry
    reg = BackendRegistry(get_redis())
    for line in sys.stdin:
        op, arg = json.loads(line)
        if op == "pause":
            control.pause(reg, [arg], "drain", wait_s=0)
        elif op == "resume":
            control.resume(reg, None, weight_version=arg)
        elif op == "register":
            reg.add(BackendSpec(probe=False, **arg))
        elif op == "quarantine":
            health.quarantine(reg, arg, "boom")
        elif op == "activate":
            reg.set_status(arg, BackendStatus.ACTIVE, [BackendStatus.QUARANTINED])
        elif op == "remove":
            reg.remove(arg)
        print("done", flush=True)
""")


def test_a_change_made_by_another_process_is_seen_by_the_next_acquire(pool):
    address = "http://10.0.0.8:1"
    bid = pool.registry.add(BackendSpec(address=address, capacity=4, model="m", weight_version="v0", probe=False))[0].id
    router = Router(pool.redis)
    writer = subprocess.Popen([sys.executable, "-c", WRITER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def elsewhere(op: str, arg) -> None:
        writer.stdin.write(json.dumps([op, arg]) + "\n")
        writer.stdin.flush()
        assert writer.stdout.readline().strip() == "done", f"the writer process failed at {op}"

    def acquire():
        slot = router.acquire("job-seen")
        if not isinstance(slot, str):
            router.release(slot, "ok")
        return slot

    def warm():  # this process holds the current record: the next acquire carries none
        acquire()
        read = router.records_read
        slot = acquire()
        assert router.records_read == read
        return slot

    try:
        assert warm().backend.weight_version == "v0"
        elsewhere("pause", bid)
        assert acquire() == "draining"
        elsewhere("resume", "v1")
        slot = acquire()
        assert slot.backend.weight_version == "v1" and slot.backend.paused_mode is None
        warm()
        elsewhere("register", {"address": address, "model": "m2", "max_model_len": 999})
        slot = acquire()
        assert (slot.backend.model, slot.backend.max_model_len, slot.backend.weight_version) == ("m2", 999, "v1")
        warm()
        elsewhere("quarantine", bid)
        assert acquire() == "quarantined"
        elsewhere("activate", bid)
        assert acquire().backend.last_error == "boom"
        warm()
        elsewhere("remove", bid)
        assert acquire() == "none"
        elsewhere("register", {"address": address, "capacity": 2, "weight_version": "v9"})
        slot = acquire()
        assert slot.backend.id == bid and (slot.backend.capacity, slot.backend.model, slot.backend.weight_version,
                                           slot.backend.last_error) == (2, None, "v9", None)
    finally:
        writer.stdin.close()
        writer.wait(10)
