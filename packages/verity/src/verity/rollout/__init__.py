"""verity.rollout."""
