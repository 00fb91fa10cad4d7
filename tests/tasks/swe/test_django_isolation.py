"""Django's runner under the grader's recorder: the command rewrite, Django-style canaries, and the
cross-check of an error (in process; the real runs are tests/security/test_reward_forgery_django.py)."""
from __future__ import annotations

import random

import pytest

from tasks.swe import integrity
from tasks.swe.integrity import canaries
from tasks.swe.runners import django_isolation

pytestmark = pytest.mark.unit  # in process (tests/unit_tier.py)

DJANGO_CMD = "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1 sitemaps_tests.test_http"


def _runner(python: str, index: int) -> str:
    return f"{python} /home/.prorl-django-runner.py nonce-{index} /home/repo"


def test_each_run_of_runtests_is_rewritten_and_nothing_else():
    command, count = django_isolation.rewrite(DJANGO_CMD, _runner)
    assert count == 1
    assert command == ("python /home/.prorl-django-runner.py nonce-0 /home/repo tests/runtests.py --verbosity 2 "
                       "--settings=test_sqlite --parallel 1 sitemaps_tests.test_http")
    twice, count = django_isolation.rewrite("X=1 python3 tests/runtests.py a && ./tests/runtests.py b", _runner)
    assert count == 2 and twice.startswith("X=1 python3 /home/.prorl-django-runner.py nonce-0")
    assert "nonce-1 /home/repo tests/runtests.py b" in twice
    assert django_isolation.rewrite("echo tests/runtests.py; cat ./tests/runtests.py.bak", _runner)[1] == 0


def test_canaries_in_django_test_classes_are_methods_django_collects():
    text = ("from .base import SitemapTestsBase\n\n\nclass HTTPSitemapTests(SitemapTestsBase):\n"
            "    def test_simple_sitemap(self):\n        self.assertEqual(1, 1)\n")
    source, planted = canaries.plan("tests/sitemaps_tests/test_http.py", text, random.Random(1))
    assert {c.cls for c in planted} != {None} and "(unittest.TestCase):" in source
    assert "self.assertEqual(len('abc'), 4)" in source
    assert f"{planted[0].name} (sitemaps_tests.test_http.{planted[0].cls})" in canaries.spellings(planted[0])
    module_style, planted = canaries.plan("tests/test_x.py", "def test_a():\n    assert 1\n", random.Random(1))
    assert {c.cls for c in planted} == {None} and "assert len('abc') == 4" in module_style


def test_a_log_pass_the_recorder_saw_as_an_error_is_forged_only_where_errors_are_reported_once():
    log = {"test_a (m.C)": "PASSED", "test_b (m.C)": "PASSED"}
    record = {"test_a (m.C)": "ERROR", "test_b (m.C)": "PASSED"}
    merged, forged = integrity.cross_check(log, record, errors_forged=True)
    assert merged == {"test_a (m.C)": "ERROR", "test_b (m.C)": "PASSED"} and forged == ["test_a (m.C)"]
    merged, forged = integrity.cross_check(log, record)  # pytest: a teardown error after a pass
    assert merged["test_a (m.C)"] == "ERROR" and forged == []
