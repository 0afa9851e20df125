"""hpcrl/tasks."""
