#!/bin/bash
# Installs its test runner as many Harbor tasks do: uv's installer, then pytest through uvx.
apt-get update
apt-get install -y curl

curl -LsSf https://astral.sh/uv/0.9.7/install.sh | sh
source $HOME/.local/bin/env

uvx --with pytest==8.4.1 pytest /tests/test_wordcount.py -rA --junitxml=/logs/verifier/junit.xml
status=$?

# pytest's exit status alone is not trusted: the code under test runs in its process and can end
# it with status 0 before a test has run (the hack audit's exit_code policy did). Every test of the
# file must be in pytest's own report, and passed.
expected=$(grep -c '^def test_' /tests/test_wordcount.py)
if [ $status -eq 0 ] && python3 -I - "$expected" /logs/verifier/junit.xml <<'PY'
import sys
import xml.etree.ElementTree as ET

expected, path = int(sys.argv[1]), sys.argv[2]
cases = ET.parse(path).getroot().iter("testcase")
passed = [c for c in cases if not any(child.tag in ("failure", "error", "skipped") for child in c)]
sys.exit(0 if expected > 0 and len(passed) == expected else 1)
PY
then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
