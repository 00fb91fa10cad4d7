"""Sandboxes: the interface, runtimes, persistent shell, per-node host and its client."""
