"""Tests of ``marind.control``."""
