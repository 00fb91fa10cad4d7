#!/bin/bash
# weak: the agent's directory copied aside and pytest run as a module from the copy (its
# directory first on sys.path), the exit status trusted.
cp -a /app /tmp/work && cd /tmp/work
if python3 -m pytest -q /tests/test_answer.py; then reward=1; else reward=0; fi
echo $reward > /logs/verifier/reward.txt
