"""hpcrl: RL post-training of MoE LLMs on Slurm/HPC clusters without Ray."""

__version__ = "0.1.0"
__all__ = ["__version__"]
