"""verity.tracking."""
