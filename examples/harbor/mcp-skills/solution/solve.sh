#!/bin/bash
# The gold answer, computed as the servers compute it (the oracle makes no MCP call).
facts=$(printf 'facts:alpha' | sha256sum | cut -c1-12)
ledger=$((16#$(printf 'ledger:acme' | sha256sum | cut -c1-6)))
echo "facts=${facts};ledger=${ledger}" > /app/answer.txt
