"""Tests of ``marind.agent.warm_start``."""
