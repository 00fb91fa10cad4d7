#!/bin/bash
# weak: it runs the tests that live in the working directory, which the agent can edit.
cd /app
if python3 -m pytest -q tests; then reward=1; else reward=0; fi
echo $reward > /logs/verifier/reward.txt
