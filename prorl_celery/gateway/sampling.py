"""Who decides how the policy samples: the trainer (the job's ``sampling_params``), never the
harness. A trainer reads logprobs at loss mask 1 as samples of the distribution it asked for; a
harness that could set ``top_k``, ``min_p``, a penalty, a seed or a temperature would have it train
on samples of another.

Each call is generated with the trainer's set (:class:`SamplingParams` defaults where the trainer
set nothing). Of what the harness sent, only what does not change the distribution of a sampled
token is kept: a lower ``max_tokens`` and more ``stop`` strings (each bounded). Everything else it
sent that differs from the trainer's set is dropped and named; ``tool_choice`` is dropped too (the
gateway generates in token mode, which forces no call) and named when it asked to force one."""
from __future__ import annotations

from typing import Any

from prorl_celery.errors import InvalidRequest
from prorl_celery.llm.models import SamplingParams

MAX_STOPS = 16
MAX_STOP_CHARS = 256
_UNFORCED = (None, "auto", "none")


class SamplingAuthority:
    """The trainer's set and what each call is generated with (:meth:`effective`)."""

    def __init__(self, trainer: dict[str, Any] | None = None):
        trainer = {k: v for k, v in (trainer or {}).items() if k != "tool_choice"}  # token mode forces none
        self.base = SamplingParams.model_validate(trainer)
        self.base_dump = self.dump(self.base)

    @staticmethod
    def dump(sampling: SamplingParams) -> dict[str, Any]:
        """The set as a call records it (None fields left out)."""
        return sampling.model_dump(exclude_none=True)

    def effective(self, asked: SamplingParams) -> tuple[SamplingParams, list[str]]:
        """The call's sampling set and the names of the fields the harness sent that were dropped."""
        sent = asked.model_fields_set | set(asked.model_extra or ())
        if not sent:
            return self.base, []
        update: dict[str, Any] = {}
        dropped: list[str] = []
        for name in sorted(sent):
            self._judge(name, getattr(asked, name, None), update, dropped)
        return (self.base.model_copy(update=update) if update else self.base), dropped

    def _judge(self, name: str, value: Any, update: dict[str, Any], dropped: list[str]) -> None:
        """One field the harness sent, ``value``: kept in ``update`` (a lower ``max_tokens``, more
        ``stop`` strings), named in ``dropped`` (what differs from the trainer's set, a forced
        ``tool_choice``), or let be."""
        if name == "max_tokens":
            if value is not None and (self.base.max_tokens is None or value < self.base.max_tokens):
                update["max_tokens"] = value
        elif name == "stop":
            if value:
                update["stop"] = _stops([*(self.base.stop or []), *value])
        elif name == "tool_choice":
            if value not in _UNFORCED:
                dropped.append(name)
        elif value != getattr(self.base, name, None):
            dropped.append(name)


def _stops(stops: list[Any]) -> list[str]:
    out = list(dict.fromkeys(stops))
    if len(out) > MAX_STOPS or any(not isinstance(s, str) or len(s) > MAX_STOP_CHARS for s in out):
        raise InvalidRequest(f"stop: at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters", "stop")
    return out
