"""``python -m sandboxes.host``: the sandbox host's command line."""
from sandboxes.host.main import cli

cli()
