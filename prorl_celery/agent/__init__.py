"""The built-in agent: a multi-turn tool-calling loop over the LLM pool and a sandbox."""
from prorl_celery.agent.loop import AgentConfig, AgentOutcome, run_agent

__all__ = ["AgentConfig", "AgentOutcome", "run_agent"]
