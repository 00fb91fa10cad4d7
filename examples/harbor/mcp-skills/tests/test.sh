#!/bin/bash
# Reward 1 when /app/answer.txt is the one line the answer-format skill prescribes, with the
# answers the two MCP servers give.
facts=$(printf 'facts:alpha' | sha256sum | cut -c1-12)
ledger=$((16#$(printf 'ledger:acme' | sha256sum | cut -c1-6)))
if [ "$(cat /app/answer.txt 2>/dev/null)" = "facts=${facts};ledger=${ledger}" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
