"""Re-scoring in process: what a Harbor result keeps (its workspace diff against the image), the
replay harness's restore script run on a folder standing for a sandbox's root, the retention,
and an answer domain's stored answer re-graded by today's handler with the original untouched.
The same paths end to end on a stack: ``tests/audit/test_rescore_e2e.py`` (``-m audit``)."""
from __future__ import annotations

import io
import os
import runpy
import sys
import tarfile
import time
from pathlib import Path

import pytest

from config.settings import Settings
from prorl_celery.fakes import ScriptedPolicy
from prorl_celery.jobs import JobRecord
from tasks.fake import FakeStage
from tasks.handlers import get_handler

pytestmark = pytest.mark.unit


class _Redis:
    """The few hash commands tasks/harbor/keep.py uses, on a dict (with the TTL remembered)."""

    def __init__(self):
        self.data: dict[str, dict[bytes, bytes]] = {}
        self.ttl: dict[str, int] = {}

    def pipeline(self, transaction: bool = True):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def hset(self, key, mapping):
        self.data.setdefault(key, {}).update({k.encode(): v for k, v in mapping.items()})

    def expire(self, key, seconds):
        self.ttl[key] = seconds

    def execute(self):
        return []

    def hgetall(self, key):
        return dict(self.data.get(key, {}))


def _tar(entries: dict[str, bytes | str | None], modes: dict[str, int] | None = None) -> bytes:
    """A tar as a sandbox host builds it: bytes are files, a str a symlink's target, None a directory."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, body in entries.items():
            info = tarfile.TarInfo(name)
            if body is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            elif isinstance(body, str):
                info.type, info.linkname = tarfile.SYMTYPE, body
                tar.addfile(info)
            else:
                info.size, info.mode = len(body), (modes or {}).get(name, 0o644)
                tar.addfile(info, io.BytesIO(body))
    return buf.getvalue()


@pytest.fixture
def image(tmp_path) -> Path:
    """A task image's rootfs: /app with a file the agent leaves alone, one it edits, one it
    deletes, a script it makes executable."""
    root = tmp_path / "rootfs"
    (root / "app").mkdir(parents=True)
    for name, body in {"same.txt": "same\n", "edited.txt": "old\n", "gone.txt": "bye\n", "run.sh": "echo\n"}.items():
        (root / "app" / name).write_text(body)
        os.chmod(root / "app" / name, 0o644)
    return root


def _final_tree() -> bytes:
    return _tar({"app": None, "app/same.txt": b"same\n", "app/edited.txt": b"new\n", "app/added.txt": b"hi\n",
                 "app/run.sh": b"echo\n", "app/link": "added.txt"}, modes={"app/run.sh": 0o755})


def test_a_harbor_workspace_keeps_only_what_differs_from_the_image_and_names_every_file(image):
    from tasks.harbor.keep import diff_against

    changed, names, same = diff_against(_final_tree(), str(image))
    with tarfile.open(fileobj=io.BytesIO(changed)) as tar:
        kept = sorted(tar.getnames())
    assert kept == ["app/added.txt", "app/edited.txt", "app/link", "app/run.sh"]  # run.sh: its mode changed
    assert sorted(names) == ["/app/added.txt", "/app/edited.txt", "/app/link", "/app/run.sh", "/app/same.txt"]
    assert same == 2  # app/ and same.txt
    whole, _, none = diff_against(_final_tree(), str(image / "elsewhere"))  # the image not on this node
    assert none == 0 and len(tarfile.open(fileobj=io.BytesIO(whole)).getnames()) == 6


def test_keep_stores_the_diff_under_the_retention_and_refuses_past_its_cap(image):
    from tasks.harbor import keep

    redis = _Redis()
    info = keep.keep(redis, "j1", 0, _final_tree(), str(image), ["/app"], Settings(job_ttl_s=900))
    assert info["workspace"] is True and info["files"] == 5 and info["unchanged"] == 2
    assert redis.ttl["prorl:regrade:j1"] == 900  # default retention: the job's TTL
    [(step, ws)] = keep.load(redis, "j1").items()
    assert step == 0 and ws["dirs"] == ["/app"] and "/app/same.txt" in ws["names"]
    keep.keep(redis, "j2", 0, _final_tree(), str(image), ["/app"], Settings(rescore_retention_s=60))
    assert redis.ttl["prorl:regrade:j2"] == 60
    assert keep.keep(redis, "j3", 0, _final_tree(), str(image), ["/app"],
                     Settings(rescore_retention_s=0))["workspace"].startswith("no: rescore_retention_s is 0")
    big = _tar({"app/noise.bin": os.urandom(1536 * 1024)})
    refused = keep.keep(redis, "j4", 0, big, str(image), ["/app"], Settings(rescore_max_mb=1))
    assert "over rescore_max_mb=1" in refused["workspace"] and "prorl:regrade:j4" not in redis.data


def test_the_replay_restores_a_kept_workspace_over_the_prepared_tree(image, tmp_path, monkeypatch):
    """The restore script the replay harness runs, on a copy of the image standing for the new
    job's sandbox (setup made a file there the agent had deleted): the tree ends as the agent left it."""
    import shutil

    from tasks.harbor import keep
    from tasks.harnesses.replay import RESTORE, Replay, ReplayConfig, workspaces_of

    redis = _Redis()
    keep.keep(redis, "j", 0, _final_tree(), str(image), ["/app"], Settings())
    config = ReplayConfig.model_validate({"workspaces": workspaces_of(keep.load(redis, "j"))})
    launch = Replay().launch(None, config)  # type: ignore[arg-type] - the task is not read
    assert launch.files["restore.py"] == RESTORE and "restore.py" in launch.command
    box = tmp_path / "box"
    shutil.copytree(image, box, symlinks=True)
    (box / "tmp").mkdir()
    (box / "app" / "from-setup.txt").write_text("setup made me; the agent removed me\n")
    harness = tmp_path / "harness"
    harness.mkdir()
    for name, text in launch.files.items():
        (harness / name).write_text(text)
    monkeypatch.setenv("PRORL_HARNESS_DIR", str(harness))
    monkeypatch.setattr(sys, "argv", ["restore.py", str(box)])
    runpy.run_path(str(harness / "restore.py"))  # in process: as the sandbox's python3 runs it
    tree = {p.name: (os.readlink(p) if p.is_symlink() else p.read_text()) for p in (box / "app").iterdir()}
    assert tree == {"same.txt": "same\n", "edited.txt": "new\n", "added.txt": "hi\n", "run.sh": "echo\n",
                    "link": "added.txt"}
    assert os.stat(box / "app" / "run.sh").st_mode & 0o111
    with pytest.raises(SystemExit, match="no kept workspace for step 1"):  # one step kept, one restored
        runpy.run_path(str(harness / "restore.py"))


def _record(instance: dict, state: dict, result: dict, finished: float | None = None,
            status: str = "completed", job_id: str = "a1") -> JobRecord:
    return JobRecord.model_validate({"job_id": job_id, "status": status, "data_source": instance["data_source"],
                                     "instance": instance, "state": state, "result": result,
                                     "t_created": 0.0, "t_finished": finished or time.time()})


def test_replay_instance_per_domain_and_retention(image):
    from tasks.audit.rescore import replay_instance
    from tasks.harbor import keep
    from tasks.harnesses import check_agent

    redis = _Redis()
    harbor = {"data_source": "harbor", "task_dir": "/t/hello", "agent": {"harness": "command", "command": "true"}}
    two_steps = {"reward": 1.0, "harbor": {"steps": [{"kept": {"workspace": True}}, {"kept": {"workspace": True}}]}}
    keep.keep(redis, "a1", 0, _final_tree(), str(image), ["/app"], Settings())
    _, why = replay_instance(_record(harbor, {}, two_steps), redis)
    assert why == "step 1's workspace is not kept (expired, or from before workspaces were kept)"
    keep.keep(redis, "a1", 1, _final_tree(), str(image), ["/app"], Settings())
    instance, why = replay_instance(_record(harbor, {}, two_steps), redis)
    assert why is None and instance["task_dir"] == "/t/hello" and len(instance["agent"]["workspaces"]) == 2
    check_agent(instance["agent"])  # the replay harness accepts it
    refused = {"reward": 0.0, "harbor": {"steps": [{"kept": {"workspace": "no: the diff is 9 bytes ..."}}]}}
    assert replay_instance(_record(harbor, {}, refused), _Redis())[1] == "step 0's workspace was not kept (no: the diff is 9 bytes ...)"
    echo = {"data_source": "echo", "text": "48213"}
    assert replay_instance(_record(echo, {}, {"reward": 1.0})) == ("answer", None)
    old = _record(echo, {}, {"reward": 1.0}, finished=time.time() - 7200)
    assert "past the re-scoring retention (rescore_retention_s=3600)" in replay_instance(
        old, settings=Settings(rescore_retention_s=3600))[1]
    assert replay_instance(old, settings=Settings())[0] == "answer"  # the default: the job's TTL
    assert "rescore_retention_s=0" in replay_instance(_record(echo, {}, {}), settings=Settings(rescore_retention_s=0))[1]
    swe = {"data_source": "swebench", "repo": "o/r"}
    assert replay_instance(_record(swe, {}, {"reward": 0.0}))[1].startswith("the result keeps no workspace diff")


def _echo_job() -> tuple[dict, dict, dict]:
    """An echo rollout run in process: its instance, the state it stored and its result."""
    instance = {"data_source": "echo", "text": "48213", "match": "contains"}
    stage = FakeStage(instance, policy=ScriptedPolicy(["Sure: 48213."]))
    handler = get_handler("echo")
    handler.init(stage)
    handler.run(stage)
    return instance, stage.state.dump(), handler.eval(stage)


class _Store:
    def __init__(self, records: dict[str, JobRecord]):
        self.raw = {k: r.model_dump_json() for k, r in records.items()}
        self.redis = _Redis()

    def get(self, job_id: str) -> JobRecord | None:
        return JobRecord.model_validate_json(self.raw[job_id]) if job_id in self.raw else None


class _NoClient:
    def submit(self, instance):
        raise AssertionError("an answer is re-graded in process, never as a job")


def test_an_answer_is_regraded_by_todays_handler_in_process_and_the_original_is_untouched(monkeypatch):
    from tasks.audit.rescore import rescore
    from tasks.handlers import echo

    instance, state, result = _echo_job()
    assert result["reward"] == 1.0
    store = _Store({"a1": _record(instance, state, result)})
    before = dict(store.raw)
    [same] = rescore(_NoClient(), store, ["a1"])
    assert (same.original, same.today, same.changed, same.how) == (1.0, 1.0, False, "answer, in process")
    monkeypatch.setattr(echo, "mentions", lambda text, value: text == value)  # a stricter grader today
    [row] = rescore(_NoClient(), store, ["a1"])
    assert (row.original, row.today, row.changed) == (1.0, 0.0, True)
    assert store.raw == before  # re-grading wrote nothing back


def test_an_answer_whose_grader_needs_a_sandbox_is_replayed_as_a_job_holding_the_stored_answer():
    """code runs its tests in a sandbox: not in process; a new job whose replay agent holds the
    stored answer, which the run then holds as its harness's (the handler reads it back the same)."""
    from tasks.audit.regrade import NeedsStage, regrade
    from tasks.audit.rescore import rescore
    from tasks.harnesses import check_agent
    from tasks.harnesses.replay import Replay, ReplayConfig
    from tasks.harnesses.runner import HARNESS

    instance = {"data_source": "code", "prompt": "add", "tests": [{"input": "1 2\n", "output": "3\n"}],
                "agent": {"harness": "command", "command": "true"}}
    code = "print(sum(map(int, input().split())))"
    state = {"agent": {"answer": code, "final_text": "done"}}
    with pytest.raises(NeedsStage):
        regrade(_record(instance, state, {"reward": 1.0}))

    class Client:
        submitted: list[dict] = []

        def submit(self, instance):
            self.submitted.append(instance)
            return "r1"

        def as_completed(self, ids, timeout=None):
            return [{"job_id": "r1", "status": "completed", "result": {"reward": 0.0}}]

    client = Client()
    [row] = rescore(client, _Store({"a1": _record(instance, state, {"reward": 1.0})}), ["a1"])
    assert (row.how, row.replay_job, row.today, row.changed) == ("answer, new job", "r1", 0.0, True)
    [replay] = client.submitted
    assert replay["agent"] == {"harness": "replay", "final_text": "done", "answer": code}
    assert replay["tests"] == instance["tests"]
    check_agent(replay["agent"])
    config = ReplayConfig.model_validate({k: v for k, v in replay["agent"].items() if k != "harness"})
    assert Replay().launch(None, config).command == "true"  # type: ignore[arg-type]
    said = Replay().stored_answer(config)
    assert HARNESS.final_answer({"harness": {"answer": said[0], "final_text": said[1]}}) == (code, "done")
    with pytest.raises(ValueError, match="one of patch, workspaces or final_text"):
        ReplayConfig.model_validate({"patch": "x", "final_text": "y"})


def test_a_refused_replay_is_said_on_its_row_and_the_others_go_on(image):
    from tasks.audit.rescore import rescore
    from tasks.harbor import keep

    class Refusing:
        def submit(self, instance):
            raise RuntimeError("409 task_quarantined: hello")

    harbor = {"data_source": "harbor", "task_dir": "/t/hello"}
    instance, state, result = _echo_job()
    store = _Store({"h": _record(harbor, {}, {"reward": 1.0, "harbor": {"steps": [{}]}}, job_id="h"),
                    "a1": _record(instance, state, result)})
    keep.keep(store.redis, "h", 0, _final_tree(), str(image), ["/app"], Settings())
    refused, answered = rescore(Refusing(), store, ["h", "a1"])
    assert refused.note == "the replay was refused: 409 task_quarantined: hello" and refused.today is None
    assert answered.today == 1.0
