"""Stand-ins for unit tests: the agent loop's ``Policy`` in process (the ``Sandbox`` stand-in is
:class:`sandboxes.fake.DummySandbox`, the stage context's :class:`tasks.fake.FakeStage`)."""
from prorl_celery.fakes.policy import ScriptedPolicy, ScriptExhausted

__all__ = ["ScriptExhausted", "ScriptedPolicy"]
