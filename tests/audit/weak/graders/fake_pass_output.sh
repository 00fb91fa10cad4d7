#!/bin/bash
# weak: any pass in the log counts (a PASSED line or an "N passed" summary), failures unread.
cd /app
python3 -m pytest -rA /tests/test_answer.py > /tmp/test.log 2>&1
if grep -qE '^PASSED|[0-9]+ passed' /tmp/test.log; then reward=1; else reward=0; fi
echo $reward > /logs/verifier/reward.txt
