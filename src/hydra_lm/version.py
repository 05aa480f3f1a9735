"""The package version (imported by the package root and by modules that record it)."""

__version__ = "0.1.0"
