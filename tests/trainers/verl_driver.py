"""Run veRL's ``prorl`` agent loop once, as veRL's rollout worker would, and print its output as
JSON: the example agent loop config (examples/verl_agent_loop.yaml) instantiated with hydra
as veRL's worker does. Started by test_verl_contract.py with the veRL venv's python (veRL pins its own
transformers). No GPU, no Ray: the server manager is a stub that fails if called, since the
service, not veRL, calls the inference servers.

    python tests/trainers/verl_driver.py '{"tokenizer": DIR, "row": {...}, "sampling_params": {...}}'
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


class StubServerManager:
    """veRL's LLM server client; the prorl loop must not use it."""

    calls = 0

    async def generate(self, *args, **kwargs):
        StubServerManager.calls += 1
        raise AssertionError("the prorl agent loop called veRL's server manager")


def main() -> None:
    import hydra
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap, _agent_loop_registry
    from verl.utils.dataset.rl_dataset import RLHFDataset

    import prorl_celery.integrations.verl as integration

    args = json.loads(sys.argv[1])
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"prompt_length": 4096,
                                                                 "response_length": args["response_length"]}},
                               "data": {"apply_chat_template_kwargs": {}}})
    registered = _agent_loop_registry["prorl"]["_target_"]  # by @register("prorl") on import
    # as veRL's AgentLoopWorker does with agent_loop_config_path: the example config, then instantiate
    for entry in OmegaConf.load(args["config"]):
        entry.prorl_url = os.environ["PRORL_API_URL"]
        _agent_loop_registry[entry.name] = entry
    loop = hydra.utils.instantiate(config=_agent_loop_registry["prorl"], trainer_config=DictConfigWrap(config),
                                   server_manager=StubServerManager(), processor=None, hf_model_type=None,
                                   tokenizer=AutoTokenizer.from_pretrained(args["tokenizer"]),
                                   dataset_cls=RLHFDataset, data_config=DictConfigWrap(config.data),
                                   tools=ToolListWrap([]))
    assert isinstance(loop, integration.ProrlAgentLoop)
    output = asyncio.run(loop.run(args["sampling_params"], **args["row"]))
    print(json.dumps({"registered": registered, "output": output.model_dump(mode="json"),
                      "server_manager_calls": StubServerManager.calls,
                      "type": f"{type(output).__module__}.{type(output).__qualname__}"}))


if __name__ == "__main__":
    main()
