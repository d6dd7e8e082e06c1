"""Checkpoints: the store, its integrity, and preemption."""
