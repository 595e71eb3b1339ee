"""Marker package: importable once `pip install -e .` has run (scripts/setup.sh checks it)."""
