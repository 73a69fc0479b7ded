"""Tests of ``ckpt_store.format``."""
