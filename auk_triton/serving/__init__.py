"""Serving on Triton: the Python-backend models, their settings and request checks, and the launcher."""
