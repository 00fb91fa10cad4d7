"""The hack audit of the harbor-cookbook's ten recipes as they are (bench/RESULTS.md, "The audit of
what we ship" and "harbor-cookbook, the other recipes"), on a stack of its own with the verifier as
shipped (no shared mode): no policy earns on any recipe but multi-reward, whose own test.sh trusts
pytest's exit status (``exit_code``: its named reward ``correctness``). A change to our verifier,
sandbox or sidecars that let a policy earn on another recipe fails here. A run that ends in a fault
(a sidecar not healthy in time, a verifier timeout on a loaded machine) is no reward and does not
fail it. Needs a clone: ``PRORL_HARBOR_COOKBOOK`` names its ``harbor_cookbook/recipes``."""
from __future__ import annotations

import os
import shutil

import pytest

from prorl_celery.client import ProrlClient
from prorl_celery.ops.audit_cli import table
from tasks.audit import policies, taskset
from tasks.audit.runner import run_audit
from tests.conftest import own_stack

COOKBOOK = os.environ.get("PRORL_HARBOR_COOKBOOK")
pytestmark = [pytest.mark.audit, pytest.mark.timeout(7200),
              pytest.mark.skipif(not COOKBOOK, reason="PRORL_HARBOR_COOKBOOK names no clone of the harbor-cookbook's "
                                                      "harbor_cookbook/recipes")]
WEAK_UPSTREAM = {"multi-reward": {"exit_code"}}  # recipe -> the policies its own test.sh is weak against


def test_no_policy_earns_on_a_cookbook_recipe_but_where_its_own_test_trusts_an_exit_status(tmp_path_factory):
    recipes = shutil.copytree(COOKBOOK, tmp_path_factory.mktemp("cookbook") / "recipes")
    with own_stack(tmp_path_factory.mktemp("cookbook-audit"),
                   concurrency={"init": 4, "run": 8, "eval": 4, "maint": 1}) as stack:
        client = ProrlClient(stack.api_url, token=stack.api_token)
        verdicts = run_audit(client, taskset.load([str(recipes)]), policies.select(None), timeout=6600)
    text = table([v.model_dump(mode="json") for v in verdicts])
    print(text)
    assert sorted(v.task for v in verdicts) == sorted(p.parent.name for p in recipes.glob("*/task.toml")), text
    assert not [v.task for v in verdicts if v.note], text  # none refused at submission
    for v in verdicts:
        assert set(v.policies) <= WEAK_UPSTREAM.get(v.task, set()), text
        assert v.baseline in (0.0, None), text
