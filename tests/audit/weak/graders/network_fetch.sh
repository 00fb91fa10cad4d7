#!/bin/bash
# honest: the weakness is the task's environment (a solution in the image, the answer in the
# working tree's history and on its remote), not this script.
cd /app
if python3 -m pytest -q /tests/test_answer.py; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
