"""Tests of ``ckpt_store.export``."""
