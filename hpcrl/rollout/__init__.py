"""hpcrl/rollout."""
