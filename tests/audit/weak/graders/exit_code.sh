#!/bin/bash
# weak: it trusts the exit status of a runner that imports the agent's code.
cd /app
python3 -m pytest -q /tests/test_answer.py
if [ $? -eq 0 ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
