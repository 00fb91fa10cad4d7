#!/bin/sh
# The container's entrypoint: the ledger MCP server in the background, then the command.
mkdir -p /logs
/opt/mcp/venv/bin/python /opt/mcp/ledger.py >/logs/ledger.log 2>&1 &
exec "$@"
