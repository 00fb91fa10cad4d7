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
# Serves on a free port and prints it; on a line on stdin prints the modules of tasks.handlers
# and tasks.verify it has loaded.
SERVE = """
import json, logging, sys, threading
from werkzeug.serving import make_server
from flask_api import create_app
logging.getLogger("werkzeug").setLevel(logging.ERROR)
server = make_server("127.0.0.1", 0, create_app(), threaded=True)
threading.Thread(target=server.serve_forever, daemon=True).start()
print(server.server_port, flush=True)
sys.stdin.readline()
print(json.dumps(sorted(m for m in sys.modules if m.startswith(("tasks.handlers", "tasks.verify")))))
"""


class ApiProcess:
    def __init__(self, child: subprocess.Popen):
        self.child = child
        self.url = f"http://127.0.0.1:{int(child.stdout.readline())}"

    def loaded_modules(self) -> list[str]:
        """The handler and grader modules the process has imported so far."""
        self.child.stdin.write("report\n")
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
