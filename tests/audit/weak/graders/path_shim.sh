#!/bin/bash
# weak: a virtualenv in the working directory first on PATH, and pytest taken from PATH.
export PATH="/app/.venv/bin:$PATH"
cd /app
if pytest -q /tests/test_answer.py; then reward=1; else reward=0; fi
echo $reward > /logs/verifier/reward.txt
