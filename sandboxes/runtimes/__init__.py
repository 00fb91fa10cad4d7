"""Parts of the sandbox runtimes (LAYOUT.md's ``sandboxes/runtimes/`` room). ``images``:
``docker://``/``oci:`` references and the registry allow-list; ``image_cache``: rootless pulls
(skopeo + umoci) into a per-host rootfs cache by digest, with a size budget and LRU eviction."""
