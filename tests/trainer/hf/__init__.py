"""Tests of ``marind.trainer.hf``."""
