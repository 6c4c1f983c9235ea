"""verity.rewards."""
