"""One module per LLM server dialect (see README.md)."""
