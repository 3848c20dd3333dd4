"""Placeholder: formats are registered here by a later commit."""
