"""The task's streamable-HTTP MCP server on 127.0.0.1:8765/mcp: ``balance(account)``."""
import hashlib

from mcp.server.fastmcp import FastMCP

server = FastMCP("ledger", host="127.0.0.1", port=8765)


@server.tool()
def balance(account: str) -> str:
    """The balance of an account, in credits."""
    return f"{account} holds {int(hashlib.sha256(f'ledger:{account}'.encode()).hexdigest()[:6], 16)} credits"


if __name__ == "__main__":
    server.run(transport="streamable-http")
