#!/bin/bash
# mode: shared
# weak: graded in the agent's own sandbox (Harbor's shared mode, which the operator allows), where
# whatever the agent left running still runs.
cd /app
if python3 -m pytest -q /tests/test_answer.py; then reward=1; else reward=0; fi
echo $reward > /logs/verifier/reward.txt
