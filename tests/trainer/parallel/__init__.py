"""Tests of ``marind.trainer.parallel``."""
