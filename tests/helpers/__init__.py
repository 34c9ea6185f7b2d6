"""Helpers shared by several test folders (tests/ is on pytest's pythonpath)."""
