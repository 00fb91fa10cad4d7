#!/bin/bash
# weak: a virtualenv in the working directory first on PATH, and pytest taken from PATH.
export PATH="/app/.venv/bin:$PATH"
cd /app
if pytest -q /tests/test_answer.py; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
