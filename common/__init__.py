"""The engine the chapters grow, and the plumbing they share."""
__version__ = "0.6.0"  # one minor version per chapter
