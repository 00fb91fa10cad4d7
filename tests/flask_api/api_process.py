"""An API process of its own for a test (``create_app()`` served over real HTTP in a fresh
interpreter): for what the shared stack cannot show, such as the modules a fresh API imports or
an API whose Redis goes away."""
from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Serves on a free port and prints it; on each line on stdin ("report [prefix ...]") prints the
# modules it has loaded under those prefixes (tasks.handlers, tasks.verify and tasks.swe by default).
SERVE = """
import json, logging, sys, threading
from werkzeug.serving import make_server
from flask_api import create_app
logging.getLogger("werkzeug").setLevel(logging.ERROR)
server = make_server("127.0.0.1", 0, create_app(), threaded=True)
threading.Thread(target=server.serve_forever, daemon=True).start()
print(server.server_port, flush=True)
for line in sys.stdin:
    prefixes = tuple(line.split()[1:]) or ("tasks.handlers", "tasks.verify", "tasks.swe")
    print(json.dumps(sorted(m for m in sys.modules if m.startswith(prefixes))), flush=True)
"""


class ApiProcess:
    def __init__(self, child: subprocess.Popen):
        self.child = child
        self.url = f"http://127.0.0.1:{int(child.stdout.readline())}"

    def loaded_modules(self, *prefixes: str) -> list[str]:
        """The modules under ``prefixes`` (default: handlers and graders) imported so far."""
        self.child.stdin.write(" ".join(["report", *prefixes]) + "\n")
        self.child.stdin.flush()
        return json.loads(self.child.stdout.readline())


@contextmanager
def api_process(env: dict[str, str] | None = None) -> Iterator[ApiProcess]:
    child = subprocess.Popen([sys.executable, "-c", SERVE], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        yield ApiProcess(child)
    finally:
        child.kill()
        child.wait(10)
