"""Speculative decoding (issue 27)."""
