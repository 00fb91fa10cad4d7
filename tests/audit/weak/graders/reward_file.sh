#!/bin/bash
# weak: the outcome goes through a staging file in the working directory, which the agent could
# have written already; a failing run leaves whatever is there.
cd /app
python3 -m pytest -q /tests/test_answer.py && echo 1 > /app/reward.txt
cp /app/reward.txt /logs/verifier/reward.txt 2>/dev/null || echo 0 > /logs/verifier/reward.txt
