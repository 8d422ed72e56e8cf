"""Shims for bugs that live in accelerate."""
