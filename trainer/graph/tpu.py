"""Placeholder (written below)."""
