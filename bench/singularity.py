"""The singularity runtime beside bwrap, in one run, on the same image recipe.

The image is tests/sandboxes/test_apptainer.py's (the host's tools, Python, git): a rootfs
directory for bwrap, and for singularity the SIF apptainer builds from it and the directory
itself. Each runtime is driven in process (no HTTP): create until the shell answers, ``echo hi``
round trips, close; interleaved across the runtimes (the node is shared). Needs scripts/install-apptainer.sh's binary.

    python bench/singularity.py [--creates 20] [--n 300]

Last line: ``sif_create_p50_ms=<> dir_create_p50_ms=<> bwrap_create_p50_ms=<> sif_exec_p50_ms=<>
bwrap_exec_p50_ms=<> sif_close_p50_ms=<> bwrap_close_p50_ms=<> create_ratio=<sif/bwrap>
exec_ratio=<sif/bwrap>``.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _ms(values: list[float], q: float = 0.5) -> float:
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)


def measure(runs: dict, creates: int, n: int) -> dict[str, dict[str, float]]:
    """Interleaved, so that the node's load (shared with others) falls on every runtime alike:
    creates round-robin, then ``echo hi`` round-robin on one open sandbox of each."""
    create = {name: [] for name in runs}
    close = {name: [] for name in runs}
    execs = {name: [] for name in runs}
    for i in range(creates):
        for name, make in runs.items():
            started = time.perf_counter()
            box = make(i)
            assert box.exec("true").exit_code == 0
            create[name].append(time.perf_counter() - started)
            started = time.perf_counter()
            box.close()
            close[name].append(time.perf_counter() - started)
    boxes = {name: make(creates) for name, make in runs.items()}
    try:
        for _ in range(n):
            for name, box in boxes.items():
                t = time.perf_counter()
                assert box.exec("echo hi").output == "hi\n"
                execs[name].append(time.perf_counter() - t)
    finally:
        for box in boxes.values():
            box.close()
    return {name: {"create_p50_ms": _ms(create[name]), "create_p90_ms": _ms(create[name], 0.9),
                   "exec_p50_ms": _ms(execs[name]), "exec_p90_ms": _ms(execs[name], 0.9),
                   "close_p50_ms": _ms(close[name])} for name in runs}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--creates", type=int, default=20)
    parser.add_argument("--n", type=int, default=300)
    args = parser.parse_args()
    binary = subprocess.run([str(REPO / "scripts" / "install-apptainer.sh")], capture_output=True,
                            text=True, check=True).stdout.split()[-1]
    os.environ["PRORL_APPTAINER_BIN"] = binary
    from sandboxes.base import SandboxSpec
    from sandboxes.runtimes.bwrap import BwrapSandbox
    from sandboxes.runtimes.singularity import SingularitySandbox
    from tests.sandboxes.test_apptainer import build_image_rootfs

    work = Path(tempfile.mkdtemp(prefix="bench-sif-"))
    work.chmod(0o711)
    rootfs = work / "rootfs"
    rootfs.mkdir()
    build_image_rootfs(rootfs)
    os.chmod(rootfs, 0o755)
    sif = work / "image.sif"
    subprocess.run([binary, "--quiet", "build", "--mksquashfs-args", "-comp gzip -Xcompression-level 1",
                    str(sif), str(rootfs)], check=True, capture_output=True)
    root = work / "ws"
    root.mkdir()
    root.chmod(0o711)
    config = {"root": str(root)}
    runs = {
        "sif": lambda i: SingularitySandbox(SandboxSpec(image=str(sif)), f"b{i}", config),
        "dir": lambda i: SingularitySandbox(SandboxSpec(image=str(rootfs)), f"d{i}", config),
        "bwrap": lambda i: BwrapSandbox(SandboxSpec(image=str(rootfs)), f"w{i}", config),
    }
    results = measure(runs, args.creates, args.n)
    for name, figures in results.items():
        print(name, figures, flush=True)
    subprocess.run(["rm", "-rf", str(work)], check=False)
    sif_r, dir_r, bw = results["sif"], results["dir"], results["bwrap"]
    print(f"sif_create_p50_ms={sif_r['create_p50_ms']} dir_create_p50_ms={dir_r['create_p50_ms']} "
          f"bwrap_create_p50_ms={bw['create_p50_ms']} sif_exec_p50_ms={sif_r['exec_p50_ms']} "
          f"bwrap_exec_p50_ms={bw['exec_p50_ms']} sif_close_p50_ms={sif_r['close_p50_ms']} "
          f"bwrap_close_p50_ms={bw['close_p50_ms']} "
          f"create_ratio={sif_r['create_p50_ms'] / bw['create_p50_ms']:.2f} "
          f"exec_ratio={sif_r['exec_p50_ms'] / bw['exec_p50_ms']:.2f}")


if __name__ == "__main__":
    main()
