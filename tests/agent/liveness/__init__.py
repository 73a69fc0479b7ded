"""Tests of ``marind.agent.liveness``."""
