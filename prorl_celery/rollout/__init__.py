"""Everything a rollout's record is: the append-only store of its calls and conversation, the
transcript an agent holds while it runs, the trajectories of both agent kinds (the built-in
agent's turns, a harness's gateway calls and their segments) and the read-time views a trainer
gets (see README.md). Nothing here imports ``tasks`` or ``sandboxes``."""
