#!/bin/bash
# weak: it runs its tests from the working directory, where the agent's conftest.py and
# pytest.ini apply.
cp /tests/test_answer.py /app/test_grading.py
cd /app
if python3 -m pytest -q test_grading.py; then reward=1; else reward=0; fi
echo $reward > /logs/verifier/reward.txt
