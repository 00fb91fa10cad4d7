"""Parts of the sandbox runtimes (LAYOUT.md's ``sandboxes/runtimes/`` room). ``images``:
``docker://``/``oci:`` references and the registry allow-list; ``image_cache``: rootless pulls
(skopeo + umoci) into a per-host rootfs cache by digest, with a size budget and LRU eviction;
``envbuild``: environments built once per node from recipes (``envrecipe``, its steps in
``envtree``, on ``envbase``'s layer of the node's packages; ``swebench_env`` makes a SWE-bench
row's recipe, ``repo_overlay`` serves modules its install generated) into cached rootfs images."""
