"""Tests of ``ckpt_store.storage``."""
