"""The OpenAPI document covers the API, and schemathesis finds no 5xx and no response that breaks it."""
from __future__ import annotations

import shutil
import subprocess

import pytest
import requests

from config.celeryconfig import QUEUES
from prorl_celery.connections import get_store
from tests.conftest import API_TOKEN, start_api, wait_until


def test_document_lists_every_route(api):
    doc = requests.get(f"{api}/openapi.json", timeout=10).json()
    assert doc["openapi"].startswith("3.")
    documented = {(method.upper(), path) for path, ops in doc["paths"].items() for method in ops}
    from flask_api import create_app

    routes = {(method, rule.rule.replace("<", "{").replace(">", "}"))
              for rule in create_app().url_map.iter_rules() if rule.endpoint != "static"
              for method in rule.methods - {"HEAD", "OPTIONS"}}
    assert routes - documented == set()
    job_request = doc["components"]["schemas"]["JobRequest"]
    assert set(job_request["required"]) == {"instance"}


@pytest.fixture
def fuzz_api(stack, tmp_path):
    """A second API process on the same service, with long polls capped at 1 s for the fuzzer."""
    child, url = start_api(stack, tmp_path, "api-fuzz", PRORL_API_MAX_WAIT_S="1")
    yield url
    child.stop()
    # The fuzzer's jobs are real ones (it learns instances from responses and posts them as
    # groups of up to n samples): end them, or they hold the workers the next tests need.
    wait_until(lambda: requests.post(f"{stack.api_url}/cancel_all", json={}, timeout=120).json()["cancelled"] == 0,
               120, "the fuzzer's jobs cancelled")
    # Their stage messages are still queued (groups of up to 4,096): the workers skip each
    # cancelled one, but a test after this one must not queue behind thousands of them.
    redis = get_store().redis
    wait_until(lambda: sum(redis.llen(queue) for queue in QUEUES) == 0, 240,
               "the fuzzer's stage messages drained")


@pytest.mark.slow  # ~20 s of fuzzing: outside the default suite's 15 minutes
def test_schemathesis_finds_no_server_error_and_no_schema_violation(fuzz_api, tmp_path):
    st = shutil.which("st") or shutil.which("schemathesis")
    assert st, "schemathesis is part of the test extras"
    done = subprocess.run(
        [st, "run", f"{fuzz_api}/openapi.json", "--checks",
         "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance",
         "--max-examples", "12", "--exclude-path", "/events", "--request-timeout", "20",
         "--generation-deterministic", "--suppress-health-check", "all",
         "--header", f"Authorization: Bearer {API_TOKEN}"],  # the stack's token (env has it too)
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
