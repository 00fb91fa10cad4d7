"""A Harbor task's docker-compose.yaml read: the subset the field uses honoured, every other key
refused naming it and the task, interpolation only from the names the operator passes, Docker's
rules for commands and healthchecks; the sweep keeps a sidecar while its job keeps its keeper."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from prorl_celery.errors import InvalidRequest
from sandboxes.protocol import SandboxEntry
from tasks.harbor import compose
from tasks.harbor.sidecars import argv, image_health
from tasks.harbor.task import load

pytestmark = pytest.mark.unit
TASKS = Path(__file__).resolve().parents[2] / "examples" / "harbor"
API = """
services:
  main:
    depends_on:
      api-server:
        condition: service_healthy
  api-server:
    build:
      context: ./api-server
    environment:
      - ANTHROPIC_API_KEY=${ANTHROPIC_API_KEY}
      - SIM_USER_MODEL=${SIM_USER_MODEL:-}
    expose:
      - "5000"
    healthcheck:
      test: ["CMD", "python3", "-c", "import socket; socket.create_connection(('localhost', 5000))"]
      interval: 2s
      timeout: 5s
      retries: 15
      start_period: 1m30s
"""


def refused(text: str) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as err:
        compose.parse(text, "t", env={})
    return err.value


def test_the_cookbook_s_form_is_honoured():
    parsed = compose.parse(API, "multi", env={"ANTHROPIC_API_KEY": "sk-1"})
    (api,) = parsed.sidecars
    assert api.name == "api-server" and api.context == "api-server" and api.ports == [5000]
    assert api.env == {"ANTHROPIC_API_KEY": "sk-1", "SIM_USER_MODEL": ""}
    assert api.health.interval_s == 2.0 and api.health.retries == 15 and api.health.start_period_s == 90.0
    assert api.health.command.startswith("python3 -c ")
    assert parsed.main_depends_on == {"api-server": "service_healthy"}


@pytest.mark.parametrize("text, field, why", [
    ("services:\n  a:\n    image: x\n    privileged: true\n", "services.a.privileged", "capabilities"),
    ("services:\n  a:\n    image: x\n    volumes: ['./d:/d']\n", "services.a.volumes", "volume"),
    ("services:\n  a:\n    image: x\n    network_mode: host\n", "services.a.network_mode", "127.0.0.1"),
    ("services:\n  a:\n    image: x\n    cap_add: [NET_ADMIN]\n", "services.a.cap_add", "capabilities"),
    ("services:\n  main:\n    build: .\n", "services.main.build", "depends_on and environment"),
    ("services:\n  a:\n    build: {context: d, target: t}\n", "services.a.build.target", "build"),
    ("services:\n  a:\n    image: x\n    healthcheck: {test: [CMD, 'true'], interval: 2x}\n",
     "services.a.healthcheck.interval", "duration"),
    ("services:\n  a:\n    build: ../../etc\n", "services.a.build.context", "beneath environment/"),
    ("services:\n  a:\n    image: x\n    ports: ['53:53/udp']\n", "services.a.ports", "TCP"),
    ("services:\n  a:\n    image: x\n    expose: [80]\n  b:\n    image: y\n    ports: ['8080:80']\n",
     "services.b.expose", "share a port"),
    ("services:\n  a:\n    image: x\n    depends_on: [b]\n  b:\n    image: y\n    depends_on: [a]\n", "services", "cycle"),
    ("services:\n  main:\n    depends_on: [ghost]\n", "services.main.depends_on.ghost", "names no service"),
    ("services:\n  a:\n    image: x\n  b:\n    image: y\n    depends_on: {a: {condition: service_healthy}}\n"
     "  c:\n    image: z\n", None, None),
    ("volumes: {data: {}}\nservices: {}\n", "volumes", "volume"),
    ("services:\n  a:\n    image: x\n    environment: {K: '${SECRET:?set it}'}\n", "services.a.environment.K", "SECRET"),
])
def test_what_cannot_be_honoured_is_refused_naming_the_key_and_the_task(text, field, why):
    if field is None:  # the control: a file of the same shape that is honoured
        assert [s.name for s in compose.parse(text, "t", env={}).sidecars] == ["a", "b", "c"]
        return
    err = refused(text)
    assert err.field == f"environment/docker-compose.yaml.{field}" and "task t" in str(err), str(err)
    assert why in str(err), str(err)


def test_only_the_names_the_operator_passes_are_interpolated(monkeypatch):
    from config.settings import get_settings

    monkeypatch.setenv("PRORL_HARBOR_COMPOSE_ENV", "SIM_USER_MODEL")
    monkeypatch.setenv("SIM_USER_MODEL", "model-x")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-host-secret")
    get_settings.cache_clear()
    try:
        (api,) = compose.parse(API, "t").sidecars
    finally:
        get_settings.cache_clear()
    assert api.env == {"ANTHROPIC_API_KEY": "", "SIM_USER_MODEL": "model-x"}  # the key is not passed: empty
    env = {"X": "1", "E": ""}
    cases = {"$$X ${X} $X": "$X 1 1", "${E:-d} ${E-d} ${U-d}": "d  d", "${X:+alt}${U:+no}": "alt"}
    for text, want in cases.items():
        assert compose.interpolate(text, env, "k", None) == want


def test_a_name_without_a_value_takes_the_operator_s_variable_and_no_other():
    """computer-use-windows passes its Daytona key as ``- DAYTONA_API_KEY`` (compose: the shell's):
    it reached the desktop server empty-handed whatever the operator passed."""
    text = """
services:
  desktop:
    image: python:3.12-slim
    environment:
      - DAYTONA_API_KEY
      - DAYTONA_API_URL
      - HOST_SECRET
  main:
    environment: {DAYTONA_API_KEY: null, OTHER: null}
"""
    scope = {"DAYTONA_API_KEY": "dtn-1", "PIP_INDEX_URL": "https://mirror"}
    parsed = compose.parse(text, "win", env=scope)
    assert parsed.sidecars[0].env == {"DAYTONA_API_KEY": "dtn-1"}  # HOST_SECRET, URL: not passed, left out
    assert parsed.main_env == {"DAYTONA_API_KEY": "dtn-1", "OTHER": ""}
    built = compose.parse(text.replace("    image: python:3.12-slim\n", "    build:\n      context: d\n"
                                       "      args: [PIP_INDEX_URL, NOPE]\n"), "win", env=scope)
    assert built.sidecars[0].args == {"PIP_INDEX_URL": "https://mirror"}


def test_start_order_commands_and_healthchecks_follow_docker():
    text = ("services:\n  web:\n    image: w\n    depends_on: {db: {condition: service_healthy}}\n"
            "  db:\n    image: d\n    command: postgres -c 'max_connections=5'\n")
    web, db = compose.parse(text, "t", env={}).sidecars[::-1]
    assert [s.name for s in compose.parse(text, "t", env={}).sidecars] == ["db", "web"]
    assert db.command == ["postgres", "-c", "max_connections=5"]
    image = {"entrypoint": ["/init"], "cmd": ["serve"]}
    assert argv(db, image) == ["/init", "postgres", "-c", "max_connections=5"]
    assert argv(web, image) == ["/init", "serve"]
    assert argv(web.model_copy(update={"entrypoint": ["run"]}), image) == ["run"]  # an entrypoint drops CMD
    check = image_health({"test": ["CMD-SHELL", "x"], "interval": "3s"})
    assert check is not None and check.interval_s == 3.0 and check.retries == 3
    assert image_health({"test": "NONE"}) is None


def test_the_example_task_loads_with_its_services(tmp_path, monkeypatch):
    from config.settings import get_settings

    monkeypatch.setenv("PRORL_HARBOR_TASK_DIRS", str(tmp_path))
    get_settings.cache_clear()
    try:
        task = load(str(Path(shutil.copytree(TASKS / "ledger", tmp_path / "ledger"))))
    finally:
        get_settings.cache_clear()
    assert [s.name for s in task.compose.sidecars] == ["ledger", "seed"]
    assert task.compose.main_env == {"LEDGER_URL": "http://ledger:8080"}
    assert task.compose.main_depends_on == {"ledger": "service_healthy", "seed": "service_completed_successfully"}


def test_the_sweep_keeps_a_sidecar_while_its_job_holds_the_keeper():
    from prorl_celery.models import JobRequest
    from prorl_celery.status import JobStatus
    from tasks.sweep.sandboxes import doomed

    class Record:
        status, sandbox = JobStatus.RUN, {"sandbox_id": "agent"}

    entry = lambda sid, keeper=None: SandboxEntry(sandbox_id=sid, host_id="h", job_id="j", runtime="bwrap",  # noqa: E731
                                                  created_at=0.0, expires_at=1e12, lease_s=60, keeper=keeper)
    assert JobRequest  # the record's shape is the store's; only status and sandbox are read here
    assert doomed(entry("side", keeper="agent"), Record(), now=100.0, grace_s=1.0) is None
    assert doomed(entry("side", keeper="old-agent"), Record(), now=100.0, grace_s=1.0) == "its job uses another sandbox"
    assert doomed(entry("stray"), Record(), now=100.0, grace_s=1.0) == "its job uses another sandbox"
