"""The ``kvgate`` command (``main``), its one-line errors (``errors``), ``kvgate doctor`` and
``kvgate demo``."""

from gateway.cli.main import app, main

__all__ = ["app", "main"]
