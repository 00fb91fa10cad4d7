#!/bin/bash
# weak: it runs the tests that live in the working directory, which the agent can edit.
cd /app
if python3 -m pytest -q tests; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
