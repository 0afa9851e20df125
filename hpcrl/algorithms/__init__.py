"""hpcrl/algorithms."""
