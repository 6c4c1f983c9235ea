"""verity.workers."""
