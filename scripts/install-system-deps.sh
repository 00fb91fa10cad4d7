#!/usr/bin/env bash
# System packages the tests use, installed when missing: bubblewrap (the rootless sandbox runtime),
# slirp4netns and nftables (a network sandbox's own user-mode network and its outbound policy,
# see sandboxes/runtimes/limits/netns.py), iproute2 (the network tests' "outside" namespace), Chromium (the Flower
# UI check), git (SWE tasks), the system Python's pytest (SWE grader tests in a sandbox), and skopeo, umoci and docker-registry (docker:// sandbox images pulled
# rootless, see sandboxes/runtimes/images.py; the registry serves the image tests), mmdebstrap (the Debian
# roots Dockerfiles are built on without a registry, sandboxes/runtimes/images/bases.py). Idempotent;
# does nothing when all are present.
# Needs root (or passwordless sudo) and apt; otherwise it says what is missing and the tests that
# need it skip with that reason.
set -euo pipefail
want=()
command -v bwrap >/dev/null 2>&1 || want+=(bubblewrap)
command -v slirp4netns >/dev/null 2>&1 || want+=(slirp4netns)
command -v nft >/dev/null 2>&1 || want+=(nftables)
command -v nsenter >/dev/null 2>&1 || want+=(util-linux)
command -v ip >/dev/null 2>&1 || want+=(iproute2)
command -v chromium >/dev/null 2>&1 || want+=(chromium)
command -v git >/dev/null 2>&1 || want+=(git)
command -v skopeo >/dev/null 2>&1 || want+=(skopeo)
command -v umoci >/dev/null 2>&1 || want+=(umoci)
command -v docker-registry >/dev/null 2>&1 || want+=(docker-registry)
command -v mmdebstrap >/dev/null 2>&1 || want+=(mmdebstrap)  # Debian bases of Dockerfile builds
/usr/bin/python3 -c 'import pytest' >/dev/null 2>&1 || want+=(python3-pytest)  # pytest in bwrap sandboxes (SWE logs)
((${#want[@]})) || exit 0
if [[ $(id -u) -eq 0 ]]; then sudo=(); elif sudo -n true 2>/dev/null; then sudo=(sudo -n); else
  echo "install-system-deps: not root and no sudo; missing: ${want[*]}" >&2; exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install-system-deps: no apt-get; missing: ${want[*]}" >&2; exit 0
fi
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq || true
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${want[@]}" >/dev/null
