"""Sampling rules of the verify stage that do not depend on the drafts (sampling/invariant.py)."""
