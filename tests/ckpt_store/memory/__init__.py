"""Tests of ckpt_store's memory tier (ckpt_store/memory)."""
