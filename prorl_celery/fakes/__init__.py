"""Stand-ins for unit tests: the agent loop's ``Policy`` and ``Sandbox`` in process."""
from prorl_celery.fakes.policy import ScriptedPolicy, ScriptExhausted
from prorl_celery.fakes.sandbox import DummySandbox

__all__ = ["DummySandbox", "ScriptExhausted", "ScriptedPolicy"]
