"""verity.batch."""
