#!/bin/bash
# weak: it runs its tests from the working directory, where the agent's conftest.py and
# pytest.ini apply.
cp /tests/test_answer.py /app/test_grading.py
cd /app
if python3 -m pytest -q test_grading.py; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
