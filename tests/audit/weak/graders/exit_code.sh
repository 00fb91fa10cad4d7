#!/bin/bash
# weak: it trusts the exit status of a runner that imports the agent's code.
cd /app
python3 -m pytest -q /tests/test_answer.py
if [ $? -eq 0 ]; then reward=1; else reward=0; fi
echo $reward > /logs/verifier/reward.txt
