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
