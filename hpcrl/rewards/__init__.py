"""hpcrl/rewards."""
