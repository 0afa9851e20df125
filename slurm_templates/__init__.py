"""Jinja2 sbatch templates rendered by `launch` (shipped as package data)."""
