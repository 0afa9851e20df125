"""checkpoints: sharded checkpoint store (HDF5), atomic commit and reshard-on-load.

Imports neither `hpcrl` nor `launch`.
"""
