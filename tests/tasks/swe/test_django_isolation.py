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


def test_canaries_in_django_test_classes_are_copies_of_its_methods_and_none_with_a_docstring():
    """Copies of the listed methods go into their own class, as Django collects them; under
    ``runtests.py`` (whose log names a test by its docstring) a test with one is never copied."""
    text = ("from .base import SitemapTestsBase\n\n\nclass HTTPSitemapTests(SitemapTestsBase):\n"
            "    def test_simple_sitemap(self):\n        self.assertEqual(self.client.get('/').status_code, 200)\n\n"
            "    def test_documented(self):\n        \"\"\"A documented test.\"\"\"\n        self.assertIn('a', 'abc')\n\n"
            "    def test_no_items(self):\n        self.assertNotIn('Last-Modified', self.client.get('/x'))\n")
    listed = {"fail": ["test_no_items (sitemaps_tests.test_http.HTTPSitemapTests)"],
              "pass": ["test_simple_sitemap (sitemaps_tests.test_http.HTTPSitemapTests)", "A documented test."]}
    for seed in range(6):
        source, planted = canaries.plan("tests/sitemaps_tests/test_http.py", text, random.Random(seed), listed, DJANGO_CMD)
        compile(source, "test_http.py", "exec")
        assert {c.cls for c in planted} == {"HTTPSitemapTests"} and "unittest" not in source
        assert {c.source for c in planted} <= {"test_simple_sitemap", "test_no_items"}, planted
        assert f"{planted[0].name} (sitemaps_tests.test_http.HTTPSitemapTests)" in canaries.spellings(planted[0])
        assert any(c.must == "fail" and c.source == "test_no_items" for c in planted)
    _, planted = canaries.plan("tests/test_x.py", text.replace("class HTTPSitemapTests", "class T"), random.Random(1),
                               {"pass": ["tests/test_x.py::T::test_documented"]}, "pytest tests/test_x.py")
    assert {c.source for c in planted if c.must == "pass"} == {"test_documented"}  # pytest names it by its name


def test_a_log_pass_the_recorder_saw_as_an_error_is_forged_only_where_errors_are_reported_once():
    log = {"test_a (m.C)": "PASSED", "test_b (m.C)": "PASSED"}
    record = {"test_a (m.C)": "ERROR", "test_b (m.C)": "PASSED"}
    merged, forged = integrity.cross_check(log, record, errors_forged=True)
    assert merged == {"test_a (m.C)": "ERROR", "test_b (m.C)": "PASSED"} and forged == ["test_a (m.C)"]
    merged, forged = integrity.cross_check(log, record)  # pytest: a teardown error after a pass
    assert merged["test_a (m.C)"] == "ERROR" and forged == []
