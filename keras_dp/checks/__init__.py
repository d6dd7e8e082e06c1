"""Refusals with the fix: data, labels, the model, and errors rewritten."""
