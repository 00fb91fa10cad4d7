"""The built-in agent: a multi-turn tool-calling loop over a policy and a sandbox."""
from tasks.agent.base import Control, FinishReason, Policy, Sandbox, Sink
from tasks.agent.config import AgentConfig, Timeouts
from tasks.agent.episode import AgentOutcome
from tasks.agent.loop import DefaultAgent, NoLimits, NoSink

__all__ = ["AgentConfig", "AgentOutcome", "Control", "DefaultAgent", "FinishReason", "NoLimits", "NoSink",
           "Policy", "Sandbox", "Sink", "Timeouts"]
