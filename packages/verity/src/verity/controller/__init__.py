"""verity.controller."""
