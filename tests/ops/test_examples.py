"""The DAPO dynamic-sampling example runs against the service and fills its batch both ways."""
from __future__ import annotations

import requests

from tests.conftest import wait_until


def test_dapo_dynamic_sampling_example(stack, api):
    from examples import dapo_dynamic_sampling

    requests.post(f"{api}/clear_llm_server", timeout=10)
    try:
        results = dapo_dynamic_sampling.run(batch=3, n=4, in_flight=5, step_s=0.002, stack=stack)
    finally:
        requests.post(f"{api}/clear_llm_server", timeout=10)
    for name in ("dynamic", "baseline"):
        r = results[name]
        assert len(r["kept"]) == 3 and r["fill_s"] > 0
        for gid in r["kept"]:  # every kept group carries a learning signal
            group = requests.get(f"{api}/groups/{gid}", timeout=10).json()
            assert group["complete"] and group["rewards"]["all_equal"] is False
    assert results["baseline"]["cancelled"] == 0

    def idle() -> bool:
        status = requests.get(f"{api}/status", timeout=10).json()
        return status["jobs"] == 0
    wait_until(idle, 30, "the dynamic run's leftovers to be cancelled or finished")
