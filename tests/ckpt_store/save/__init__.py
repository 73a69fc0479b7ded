"""Tests of ``ckpt_store.save``."""
