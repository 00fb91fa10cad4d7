#!/bin/bash
set -e
curl -sf -X POST "$LEDGER_URL/entries" -H 'Content-Type: application/json' -d '{"name": "harbor"}'
curl -sf "$LEDGER_URL/entries" > /app/entries.json
