"""The per-node sandbox host: serves sandboxes of its runtimes over HTTP (``python -m sandboxes.host``)."""
