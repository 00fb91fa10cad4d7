"""Environments built once per node from a generic recipe into a cached rootfs image."""
