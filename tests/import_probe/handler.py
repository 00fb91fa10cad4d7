"""A handler whose module marks its import (the control: the mark shows an import when one happens).
Its check refuses every instance, so a request naming it stores nothing."""
from __future__ import annotations

from prorl_celery.errors import InvalidRequest
from tasks.handlers.base import AgentHandler
from tests.import_probe import mark

mark(__name__)


class MarkedHandler(AgentHandler):
    def init(self, ctx) -> None:
        pass

    def run(self, ctx) -> None:
        pass

    def eval(self, ctx) -> dict:
        return {"reward": 1.0}

    def check_instance(self, instance: dict) -> None:
        raise InvalidRequest("MarkedHandler takes no jobs", field="instance")
