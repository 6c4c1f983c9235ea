"""verity.hardware."""
