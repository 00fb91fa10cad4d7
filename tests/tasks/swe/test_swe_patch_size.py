"""A SWE patch is graded whole, whatever its size up to the operator's limit.

The agent's view of a command's output keeps 16,000 characters (head and tail); the patch is
read through a file instead. In process: :func:`tasks.swe.handler.read_patch` on a real shell
in a local sandbox. Through the service: a 40 kB honest patch (the fix plus a generated table
module) resolves."""
from __future__ import annotations

import json
import shlex

import pytest
import requests

from prorl_celery.fakes import swe
from sandboxes.base import SandboxSpec
from sandboxes.runtimes.local import LocalSandbox
from tasks.swe.handler import read_patch, too_large
from tests.conftest import submit, wait

ROWS = 3000  # ~16 characters a line in the patch: well past the 16,000-character view
TABLE = f"python3 -c \"open('statkit/table.py', 'w').write(''.join(f'ROW_{{i}} = {{i * i}}\\n' for i in range({ROWS})))\""


def _repo_with_a_large_change(box: LocalSandbox) -> tuple[str, str]:
    root = f"{box.host_dir}/repo"
    setup = (f"mkdir -p {root}/statkit && cd {root} && git init -q && git config user.email t@t && git config user.name t "
             f"&& echo 'x = 1' > statkit/__init__.py && git add -A && git commit -qm base && {TABLE} "
             "&& git rev-parse HEAD")
    out = box.exec(setup, timeout=60)
    assert out.exit_code == 0, out.output
    return root, out.output.strip().splitlines()[-1]


def test_read_patch_is_whole_past_the_output_view_and_refused_past_the_cap(tmp_path):
    box = LocalSandbox(SandboxSpec(), "patch-size", {"root": str(tmp_path)})
    try:
        root, base = _repo_with_a_large_change(box)
        seen = box.exec(f"cd {root} && git add -A && git diff --cached {base} --binary", timeout=60).output
        patch, size = read_patch(box, root, base, cap=1 << 20)
        assert size == len(patch.encode()) > 40_000 and len(seen) < size  # the view is cut, the file is not
        assert f"+ROW_{ROWS - 1} = {(ROWS - 1) ** 2}\n" in patch and patch.count("\n+ROW_") == ROWS
        assert box.exec(f"cd {root} && git apply --check -R - <<'EOF'\n{patch}EOF\n").exit_code == 0
        assert read_patch(box, root, base, cap=10_000) == (None, size)
        assert not box.exec(f"ls -A {shlex.quote(str(box.host_dir))}").output.count(".prorl-patch")
    finally:
        box.close()
    finish = too_large(size, 10_000)
    assert finish["reward"] == 0.0 and finish["filter"] is True
    assert finish["eval"]["error"]["type"] == "patch_too_large" and finish["eval"]["patch_bytes"] == size


def _played(stack, api, tmp_path, instance: dict, command: str, name: str) -> dict:
    """The result of ``instance`` for an agent that runs ``command`` and submits."""
    script = tmp_path / f"{name}.json"
    script.write_text(json.dumps([{"tool_calls": [{"name": "bash", "arguments": {"command": command}}]},
                                  {"tool_calls": [{"name": "submit", "arguments": {}}]}]))
    requests.post(f"{api}/clear_llm_server", timeout=10)
    url = stack.start_fake_llm(name=name, extra_args=["--policy", f"scripted:{script}", "--latency-model", "none"])
    assert requests.post(f"{api}/llm_servers", json={"address": url, "protocol": "generate", "dialect": "fake"}, timeout=10).ok
    try:
        view = wait(api, submit(api, instance), timeout=180)
    finally:
        requests.post(f"{api}/clear_llm_server", timeout=10)
    assert view["status"] == "completed", view["result"]
    return view["result"]


def test_a_40kb_honest_patch_resolves(stack, api, tmp_path):
    instance = swe.build("statkit", tmp_path / "repos")
    fixed = (swe.HERE / "statkit" / "fixed" / "statkit" / "central.py").read_text()
    result = _played(stack, api, tmp_path, instance, f"cat > statkit/central.py <<'PRORL_EOF'\n{fixed}PRORL_EOF\n{TABLE}",
                     "fake-large-fix")
    assert len(result["git_patch"]) > 40_000 and result["git_patch"].count("\n+ROW_") == ROWS
    assert result["resolved"] is True and result["reward"] == 1.0, result["eval"]
    assert result["eval"]["applied"] == {"model_patch": True, "test_patch": True}


@pytest.mark.slow
def test_a_patch_past_the_operator_limit_is_a_typed_filtered_finish(stack, api, tmp_path):
    """9 MB of new data against the default swe_patch_max_mb of 8: not graded, not cut."""
    instance = swe.build("statkit", tmp_path / "repos")
    big = "head -c 9437184 /dev/zero | tr '\\0' 'a' | fold -w 100 > statkit/blob.txt && wc -c statkit/blob.txt"
    result = _played(stack, api, tmp_path, instance, big, "fake-huge-patch")
    assert result["reward"] == 0.0 and result["resolved"] is False and result["filter"] is True
    assert result["git_patch"] == "" and result["eval"]["error"]["type"] == "patch_too_large", result["eval"]
    assert result["eval"]["patch_bytes"] > result["eval"]["limit_bytes"] == 8 << 20
