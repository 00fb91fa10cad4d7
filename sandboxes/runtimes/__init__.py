"""The sandbox runtimes (``bwrap``, ``singularity``, ``local``) and their parts, in LAYOUT.md's
``sandboxes/runtimes/`` room: ``shell/`` the persistent bash each runs its commands in;
``images/`` rootless pulls (skopeo + umoci) into a per-host rootfs cache by digest, its leases,
SIF images; ``limits/`` cgroups, disk quota, mount and network namespaces, uids; ``env/``
environments built once per node from a generic recipe (a domain makes the recipe: the SWE room's
``tasks.swe.env``) into cached rootfs images."""
