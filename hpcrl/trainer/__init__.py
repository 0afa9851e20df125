"""hpcrl/trainer."""
