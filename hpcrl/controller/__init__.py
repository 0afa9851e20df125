"""hpcrl/controller."""
