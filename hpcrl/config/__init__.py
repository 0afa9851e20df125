"""hpcrl/config."""
