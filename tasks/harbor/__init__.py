"""Harbor task folders as a domain (``data_source: harbor``); see README.md."""
