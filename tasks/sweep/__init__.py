"""The beat's jobs: reconcile jobs with their stages, re-send lost stages, sweep sandboxes and hosts."""
