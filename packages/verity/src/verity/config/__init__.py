"""verity.config."""
