"""Tests of ``marind.trainer.model``."""
