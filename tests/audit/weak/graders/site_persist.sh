#!/bin/bash
# weak: the working directory on PYTHONPATH, so a sitecustomize.py there runs in the test's interpreter.
cd /app
if PYTHONPATH=/app python3 -m pytest -q /tests/test_answer.py; then reward=1; else reward=0; fi
echo $reward > /logs/verifier/reward.txt
