#!/bin/bash
# weak: only a test that fails counts against the agent; a run cut by the timeout gets the benefit
# of the doubt.
cd /app
timeout -k 2 10 python3 -m pytest -q /tests/test_answer.py
rc=$?
if [ $rc -eq 0 ] || [ $rc -eq 124 ] || [ $rc -eq 137 ]; then reward=1; else reward=0; fi
echo $reward > /logs/verifier/reward.txt
