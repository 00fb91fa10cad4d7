"""The fake LLM server: the real servers' APIs and quirks, as recorded (``prorl-celery fake-llm``)."""
