"""The task's stdio MCP server: ``lookup(key)`` answers a fact only it knows (a hash of the key)."""
import hashlib

from mcp.server.fastmcp import FastMCP

server = FastMCP("facts")


@server.tool()
def lookup(key: str) -> str:
    """Look up the fact stored under key."""
    return f"{key} is {hashlib.sha256(f'facts:{key}'.encode()).hexdigest()[:12]}"


if __name__ == "__main__":
    server.run(transport="stdio")
