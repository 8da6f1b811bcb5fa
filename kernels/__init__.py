"""Filled in by later commits."""
