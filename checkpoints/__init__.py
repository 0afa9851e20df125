"""checkpoints: sharded checkpoint store on HDF5 with atomic commit and reshard-on-load.

Every rank writes its slices of the global tensors (and small per-rank blobs) into its own shard
file; rank 0 commits a manifest once all shards are durable, with no collective; readers assemble
any global box from the stored slices, whatever layout wrote them. See checkpoints/README.md.
Imports neither `hpcrl` nor `launch`; the slice algebra is `moe.slices.Box`.
"""

import importlib

from .catalog import apply_retention, discard_newer, latest_pointer, latest_step, list_checkpoints, read_metadata
from .errors import (CheckpointError, CheckpointExistsError, CheckpointNotFoundError, CommitError,
                     CommitTimeoutError, CorruptCheckpointError)
from .manifest import FORMAT_VERSION, Manifest
from .store import LocalFSStore, MemoryStore, ShardStore

# The reader and writer need torch; they load on first use, so listing checkpoints (what
# `hpcrl run` does before it starts the job) costs no torch import.
_LAZY = {"CheckpointReader": ".reader", "VerifyReport": ".reader", "open_checkpoint": ".reader",
         "verify": ".reader", "CheckpointWriter": ".writer", "SaveResult": ".writer"}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'checkpoints' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CheckpointReader",
    "CheckpointWriter",
    "CommitError",
    "CommitTimeoutError",
    "CorruptCheckpointError",
    "LocalFSStore",
    "Manifest",
    "MemoryStore",
    "SaveResult",
    "ShardStore",
    "VerifyReport",
    "apply_retention",
    "discard_newer",
    "latest_pointer",
    "latest_step",
    "list_checkpoints",
    "open_checkpoint",
    "read_metadata",
    "verify",
]
