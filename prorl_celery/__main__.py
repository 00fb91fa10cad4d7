"""``python -m prorl_celery``: the ``prorl-celery`` command."""
import sys

from prorl_celery.ops.cli import main

sys.exit(main())
