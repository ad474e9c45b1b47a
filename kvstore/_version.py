"""Package version (one place; pyproject carries the same number)."""

__version__ = "0.1.0"
