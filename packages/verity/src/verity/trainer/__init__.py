"""verity.trainer."""
