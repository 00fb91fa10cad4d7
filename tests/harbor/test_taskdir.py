"""Harbor task folders read whole: task.toml keys honoured or refused by name, steps, rewards."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from prorl_celery.errors import InvalidRequest, PolicyDenied, VerifierFailed
from tasks.harbor import config as cfg
from tasks.harbor import verifier
from tasks.harbor.task import load

pytestmark = pytest.mark.unit
TASKS = Path(__file__).resolve().parents[2] / "examples" / "harbor"


@pytest.fixture
def allowed(tmp_path, monkeypatch):
    from config.settings import get_settings

    monkeypatch.setenv("PRORL_HARBOR_TASK_DIRS", str(tmp_path))
    get_settings.cache_clear()
    yield tmp_path
    get_settings.cache_clear()


def copy(name: str, root: Path) -> Path:
    return Path(shutil.copytree(TASKS / name, root / name))


def test_every_fixture_task_loads(allowed):
    hello = load(str(copy("hello", allowed)))
    assert hello.name == "prorl/hello" and not hello.multi_step
    assert [s.name for s in hello.steps] == ["main"] and hello.steps[0].verifier_timeout_s == 60.0
    assert "good morning" in hello.steps[0].instruction and hello.steps[0].solution is not None
    scores = load(str(copy("scores", allowed)))
    assert scores.config.environment.docker_image == "debian:bookworm-slim"
    assert scores.steps[0].verifier_env == {"LIMIT": "3"}
    stages = load(str(copy("stages", allowed)))
    assert [s.name for s in stages.steps] == ["make", "extend"] and stages.strategy() == "mean"
    make, extend = stages.steps
    assert make.min_reward == 1.0 and make.agent_timeout_s == 60.0 and make.verifier_timeout_s == 30.0
    assert extend.verifier_env == {"WANT": "3"} and extend.healthcheck.retries == 2
    assert extend.workdir_files is not None and (extend.workdir_files / "setup.sh").is_file()
    assert [d.name for d in extend.tests] == ["tests", "tests"]  # the task's, then the step's
    assert [a.source for a in extend.artifacts] == ["/srv/tool/count.sh"]


def test_a_folder_outside_the_allowed_roots_is_refused(allowed, tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    with pytest.raises(PolicyDenied) as err:
        load(str(copy("hello", elsewhere)))
    assert err.value.field == "instance.task_dir"
    link = allowed / "link"
    link.symlink_to(elsewhere / "hello")
    with pytest.raises(PolicyDenied):
        load(str(link))  # resolved: the link leads out


@pytest.mark.parametrize("toml,key", [
    ('[environment]\ngpus = 1', "environment.gpus"),
    ('[environment]\nos = "windows"', "environment.os"),
    ('[agent]\nuser = "agent"', "agent.user"),
    ('[verifier]\nuser = 1000', "verifier.user"),
    ('[environment]\nnetwork_mode = "allowlist"\nallowed_hosts = ["pypi.org"]', "environment.allowed_hosts"),
    ('[verifier]\ncollect = [{command = "x", service = "db"}]', "verifier.collect"),
    ('[verifier.environment]\ndocker_image = "x"', "verifier.environment"),
    ('schema_version = "2.0"', "schema_version"),
    ('[environment]\nfancy = 1', "environment.fancy"),
    ('colour = "blue"', "colour"),
    ('artifacts = [{source = "/x", service = "db"}]', "artifacts"),
])
def test_a_key_that_cannot_be_honoured_is_refused_by_name(toml, key):
    with pytest.raises(InvalidRequest) as err:
        cfg.parse(toml)
    assert err.value.field == f"task.toml.{key}", err.value
    assert key.split(".")[-1] in str(err.value)


def test_legacy_forms_are_read_as_harbor_reads_them():
    config = cfg.parse('version = "1.0"\n[environment]\nmemory = "2G"\nstorage = "512M"\nallow_internet = false')
    assert config.schema_version == "1.0"
    assert config.environment.memory_mb == 2048 and config.environment.storage_mb == 512
    assert not cfg.wants_internet(config)
    assert cfg.wants_internet(cfg.parse(""))  # Harbor's default network is public
    assert not cfg.wants_internet(cfg.parse('[agent]\nnetwork_mode = "no-network"'), cfg.parse(
        '[agent]\nnetwork_mode = "no-network"').agent)


def test_compose_tasks_and_missing_files_are_refused_naming_the_task(allowed):
    task = copy("hello", allowed)
    (task / "environment" / "docker-compose.yaml").write_text("services:\n  db:\n    image: x\n    privileged: true\n")
    with pytest.raises(InvalidRequest, match="prorl/hello.*services.db.privileged"):
        load(str(task))
    other = copy("scores", allowed)
    (other / "tests" / "test.sh").unlink()
    with pytest.raises(InvalidRequest, match="test.sh"):
        load(str(other))


def test_rewards_come_only_from_well_formed_files():
    assert verifier.parse_rewards(b"1\n", None) == {"reward": 1.0}
    assert verifier.parse_rewards(b"0", b'{"a": 1, "b": 0.5}') == {"a": 1.0, "b": 0.5}  # json wins
    for bad_txt, bad_json in ((None, None), (b"", b""), (b"yes", None), (None, b"[1]"), (None, b'{"a": "1"}'),
                              (None, b'{"a": NaN}'), (b"inf", None), (None, b"{}")):
        with pytest.raises(VerifierFailed):
            verifier.parse_rewards(bad_txt, bad_json)
    assert verifier.headline({"reward": 0.25, "x": 1}) == 0.25
    assert verifier.headline({"correctness": 1, "style": 0}) == 0.5


def test_steps_roll_up_and_stop_as_harbor_does():
    steps = [{"rewards": {"reward": 1.0}}, {"rewards": {"reward": 0.5, "extra": 1.0}}]
    assert verifier.roll_up(steps, "mean") == {"extra": 0.5, "reward": 0.75}
    assert verifier.roll_up(steps, "final") == {"reward": 0.5, "extra": 1.0}
    assert verifier.roll_up(steps[:1], "final") == {"reward": 1.0}  # stopped early: the stopping step's
    assert verifier.min_reward_failure({"reward": 0.4}, 0.5) is not None
    assert verifier.min_reward_failure({"reward": 0.5}, 0.5) is None
    assert verifier.min_reward_failure({"reward": 1.0}, {"safety": 1.0}) is not None  # a missing name fails
    assert verifier.min_reward_failure(None, None) is None
