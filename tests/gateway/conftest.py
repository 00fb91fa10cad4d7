"""The fake LLM processes and the pool of tests/llm, for the gateway's tests."""
from tests.llm.conftest import fake_llms, pool, redis_conn, script  # noqa: F401 - pytest fixtures
