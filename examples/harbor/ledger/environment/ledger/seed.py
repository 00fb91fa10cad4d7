"""Seed the ledger once, then exit 0 (the task's main waits for it to complete)."""
import json
import sys
import urllib.request

request = urllib.request.Request(f"{sys.argv[1]}/entries", data=json.dumps({"name": "seeded"}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
print(urllib.request.urlopen(request, timeout=10).read().decode())
