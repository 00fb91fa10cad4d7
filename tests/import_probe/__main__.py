"""Like a package's CLI: run at import, it ends the process. Its class has a handler's shape, so only
the rule against ``__main__`` modules keeps a request from importing it."""
from __future__ import annotations

from tests.import_probe import mark


class ProbeHandler:
    def init(self, ctx) -> None:
        pass

    def run(self, ctx) -> None:
        pass

    def eval(self, ctx) -> dict:
        return {"reward": 1.0}


mark(__name__)
raise SystemExit("tests.import_probe.__main__ ran at import")
