"""Tests of ``marind.trainer.data``."""
