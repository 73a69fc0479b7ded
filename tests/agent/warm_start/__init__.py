"""tests.agent.warm_start."""
