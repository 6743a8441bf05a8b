"""See functional.py."""
