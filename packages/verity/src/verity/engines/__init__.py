"""verity.engines."""
