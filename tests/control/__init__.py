"""tests.control."""
