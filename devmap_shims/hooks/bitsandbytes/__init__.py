"""Shims for bugs that live in bitsandbytes."""
