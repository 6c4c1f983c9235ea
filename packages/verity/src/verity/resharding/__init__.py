"""verity.resharding."""
