"""slurm_scripts/common.sh's supervision without Slurm: a component that exits stops the stack,
unless it has a restart command (head.sbatch gives one to each store shard), which is run at most
PRORL_RESTART_MAX times. Bash and ``sleep`` only, a second or two."""
from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRELUDE = f"""
set -uo pipefail
PRORL_SLURM_DIR={ROOT / "slurm_scripts"}
PRORL_ROLE=test
source "$PRORL_SLURM_DIR/common.sh" || exit 9
PRORL_LOG_PREFIX=t
PRORL_PID_FILE=$PRORL_LOG_DIR/t.pids
prorl_start shard sleep 60
prorl_start api sleep 60
PRORL_RESTART[shard]="prorl_start shard sleep 60"
crash() {{ local pid=${{PRORL_PIDS[$1]}}; kill -KILL "$pid"; wait "$pid" 2>/dev/null; prorl_check_children; }}
report() {{ echo "stopping=$PRORL_STOPPING exit=$PRORL_EXIT shard=${{PRORL_PIDS[shard]:-}} api=${{PRORL_PIDS[api]:-}}"; }}
"""


def run(tmp_path: Path, body: str, **env: str) -> tuple[list[dict[str, str]], str]:
    """``body`` run after the prelude: each ``report`` line as a dict, and what was logged."""
    script = PRELUDE + body + "\nprorl_stop shard api\n"
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "PRORL_LOG_DIR": str(tmp_path), **env})
    assert out.returncode == 0, out.stderr
    rows = [dict(word.split("=", 1) for word in line.split()) for line in out.stdout.splitlines()]
    return rows, out.stderr


def test_a_component_with_a_restart_command_is_started_again(tmp_path):
    (before, after, alive), log = run(tmp_path, "report; crash shard; report; kill -0 ${PRORL_PIDS[shard]} && echo alive=1")
    assert alive == {"alive": "1"} and "shard exited (status 137): starting it again (1 of 10)" in log, log
    assert after["stopping"] == "0" and after["exit"] == "0", after
    assert after["shard"] and after["shard"] != before["shard"] and after["api"] == before["api"]
    recorded = [line.split() for line in (tmp_path / "t.pids").read_text().splitlines()]
    assert [pid for name, pid in recorded if name == "shard"] == [before["shard"], after["shard"]]


def test_any_other_component_that_exits_stops_the_stack(tmp_path):
    (after,), log = run(tmp_path, "crash api; report")
    assert "exited (status 137): stopping" in log, log
    assert after["stopping"] == "1" and after["exit"] == "1" and after["api"] == "", after
    assert after["shard"]  # still recorded: the caller's stop_all stops it


def test_restarts_are_bounded(tmp_path):
    (first, second), log = run(tmp_path, "crash shard; report; crash shard; report", PRORL_RESTART_MAX="1")
    assert "after 1 restarts: no more" in log, log
    assert first["stopping"] == "0", first
    assert second["stopping"] == "1" and second["exit"] == "1" and second["shard"] == "", second


def test_a_restart_that_fails_stops_the_stack_and_leaves_its_process_to_stop(tmp_path):
    body = 'PRORL_RESTART[shard]="prorl_start shard sleep 60 && false"; report; crash shard; report'
    (before, after), log = run(tmp_path, body)
    assert after["stopping"] == "1" and after["exit"] == "1" and "did not start again" in log, log
    assert after["shard"] and after["shard"] != before["shard"]  # the new one, for stop_all
