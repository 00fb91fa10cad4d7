"""A handler with the built-in agent's records and no LLM or sandbox: ``instance["turns"]`` turns,
``instance["turn_s"]`` apart, each saved as it ends (tests/chaos/test_shard_kill.py). A redelivery
resumes from the turns saved; eval rewards 1 only for exactly the turns asked, in order, once each."""
from __future__ import annotations

import time

from prorl_celery.rollout.results import agent_result_fields

SHAPE = {"response": 8, "observation": 16}


def _turn(k: int):
    """Turn k as the built-in agent records it (ids and logprobs included), no LLM called."""
    from prorl_celery.llm.models import Protocol, Turn

    response = [(k * 7 + i) % 50000 for i in range(SHAPE["response"])]
    call = {"id": f"call_{k}", "name": "bash", "arguments": "{}"}
    return Turn(backend_id="shards", address="http://shards.invalid", weight_version="v0", protocol=Protocol.CHAT,
                model="shards", content=f"Step {k}: look at the tools available.", tool_calls=[call],
                finish_reason="tool_calls", prompt_ids=_prompt(k), response_ids=response,
                logprobs=[-0.25] * len(response), token_source="server", message_count=2 + 2 * k,
                started_at=time.time(), latency_s=0.0)


def _prompt(k: int) -> list[int]:
    """Turn k's prompt: the first prompt, then each earlier turn's response and observation."""
    prompt = list(range(32))
    for j in range(k):
        prompt += [(j * 7 + i) % 50000 for i in range(SHAPE["response"])] + [7] * (SHAPE["observation"] + 55)
    return prompt


class TurnsHandler:
    name = "shard-turns"

    def init(self, ctx) -> None:
        pass

    def run(self, ctx) -> None:
        transcript = ctx.transcript
        if not transcript.messages:
            transcript.messages.append({"role": "user", "content": ctx.job_id})
        for k in range(len(transcript.turns()), int(ctx.instance["turns"])):
            ctx.check()
            time.sleep(float(ctx.instance.get("turn_s", 0.1)))
            transcript.answer(_turn(k))
            transcript.messages.append({"role": "tool", "tool_call_id": f"call_{k}", "content": f"o{k}"})
            ctx.state.setdefault("agent", {}).update(turn_count=k + 1)
            ctx.save()

    def eval(self, ctx) -> dict:
        said = [m["content"] for m in ctx.transcript.messages if m["role"] == "tool"]
        exact = said == [f"o{k}" for k in range(int(ctx.instance["turns"]))]
        return {"reward": 1.0 if exact and len(ctx.transcript.turns()) == len(said) else 0.0, "resolved": exact}

    def result_fields(self, state: dict) -> dict:
        return agent_result_fields(state)
