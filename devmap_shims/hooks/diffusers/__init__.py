"""Shims for bugs that live in diffusers."""
