"""Tests of ``ckpt_store.load``."""
