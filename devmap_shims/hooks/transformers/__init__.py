"""Shims for bugs that live in transformers."""
