"""Notebooks (committed without outputs) and the runner that executes them (``run.py``)."""
