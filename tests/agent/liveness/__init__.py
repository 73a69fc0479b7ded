"""tests.agent.liveness."""
