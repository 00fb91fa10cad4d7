"""The trainer SDK stands alone: importing it builds no Celery app, while ``celery -A prorl_celery``
still finds the app (Celery's own look-up, in a fresh interpreter each)."""
from __future__ import annotations

import subprocess
import sys


def _fresh(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_importing_the_client_imports_no_celery():
    assert _fresh("import sys, prorl_celery.client\n"
                  "print(sorted(m for m in ('celery', 'kombu', 'prorl_celery.celery_app') if m in sys.modules))") == "[]"


def test_celery_dash_a_finds_the_app():
    assert _fresh("from celery.app.utils import find_app\n"
                  "app = find_app('prorl_celery')\n"
                  "app.loader.import_default_modules()\n"
                  "print(app.main, 'prorl.run' in app.tasks)") == "prorl_celery True"


def test_the_production_app_includes_no_fake():
    """The benchmark's bare chain links Celery's built-in ``celery.accumulate``: nothing of
    ``prorl_celery.fakes`` is in the app's includes, and no fake task is registered."""
    out = _fresh("from prorl_celery.celery_app import app\n"
                 "app.loader.import_default_modules()\n"
                 "print(list(app.conf.include), sorted(t for t in app.tasks if not t.startswith('celery.')),"
                 " 'celery.accumulate' in app.tasks)")
    # tasks.worker_memory: the run worker's own memory cgroup (a worker_process_init signal, no task)
    assert out == ("['tasks.stages', 'tasks.sweep.beat', 'tasks.worker_memory'] "
                   "['prorl.eval', 'prorl.init', 'prorl.run', 'prorl.sweep'] True")
