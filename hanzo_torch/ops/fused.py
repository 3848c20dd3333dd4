"""Placeholder for the fused ops."""
