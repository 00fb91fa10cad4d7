"""The API while its job store (Redis) is down: a 503 ``store_unavailable`` the client retries,
never a 500 ``internal`` (the chaos run saw ``BusyLoadingError`` answered as a 500 while a
restarted Redis loaded its AOF); once Redis is back the same API process answers again."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import redis
import requests

from prorl_celery.ops.procs import free_port
from prorl_celery.ops.redis_server import redis_server_binary
from tests.flask_api.api_process import api_process

TOKEN = "outage-test-token"


def _redis(port: int, tmp_path: Path) -> subprocess.Popen:
    proc = subprocess.Popen([redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 20
    while True:
        try:
            client.ping()
            return proc
        except redis.ConnectionError:
            assert time.monotonic() < deadline, "redis did not come up"
            time.sleep(0.05)


def test_a_redis_outage_is_a_503_the_client_retries_and_the_api_recovers(tmp_path):
    port = free_port()
    store = _redis(port, tmp_path)
    env = {**os.environ, "PRORL_REDIS_URL": f"redis://127.0.0.1:{port}/0", "PRORL_API_TOKEN": TOKEN}
    env.pop("PRORL_RESULT_URL", None)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    try:
        with api_process(env) as api:
            assert requests.get(f"{api.url}/jobs/nope", headers=headers, timeout=30).status_code == 404
            store.kill()
            store.wait(10)
            down = requests.get(f"{api.url}/jobs/nope", headers=headers, timeout=60)
            assert down.status_code == 503, down.text
            assert down.json()["error"]["type"] == "store_unavailable" and down.headers["Retry-After"] == "1"
            job = {"instance": {"data_source": "gsm8k", "problem": "1+1", "answer": "2"}}
            submit = requests.post(f"{api.url}/jobs", json=job, headers=headers, timeout=60)
            assert submit.status_code == 503 and submit.json()["error"]["type"] == "store_unavailable"
            store = _redis(port, tmp_path)  # back, empty: the same process answers again
            assert requests.get(f"{api.url}/jobs/nope", headers=headers, timeout=30).status_code == 404
    finally:
        store.kill()
        store.wait(10)
