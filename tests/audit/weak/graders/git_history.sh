#!/bin/bash
# honest: the weakness is the task's environment (a solution in the image, the answer in the
# working tree's history and on its remote), not this script.
cd /app
if python3 -m pytest -q /tests/test_answer.py; then reward=1; else reward=0; fi
echo $reward > /logs/verifier/reward.txt
