"""moe: MoE model specs, parallel layouts, Megatron <-> HF name maps and weight resharding.

Imports neither `hpcrl` nor `launch`.
"""
