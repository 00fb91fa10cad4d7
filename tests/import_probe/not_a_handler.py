"""A module of an allowed package whose class is no handler, with a side effect at import."""
from __future__ import annotations

from tests.import_probe import mark

mark(__name__)
raise SystemExit("tests.import_probe.not_a_handler ran at import")


class Thing:
    def start(self) -> None:
        pass
