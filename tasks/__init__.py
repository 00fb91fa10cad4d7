"""The task graph: stage tasks, the chain builder and canceller, the beat sweep, and the handlers."""
