#!/bin/bash
# Reward 1 when /app/entries.json is the ledger with the seeded entry and "harbor" in it.
python3 - <<'PY'
import json
try:
    names = [e["name"] for e in json.load(open("/app/entries.json"))]
except Exception:
    names = []
ok = names[:2] == ["genesis", "seeded"] and "harbor" in names
open("/logs/verifier/reward.txt", "w").write("1\n" if ok else "0\n")
PY
