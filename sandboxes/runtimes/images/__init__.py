"""Images on a sandbox host: rootless pulls, the per-host rootfs cache and its leases, SIF images."""
