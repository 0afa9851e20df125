"""hpcrl/models."""
