"""checkpoints: sharded checkpoint store on HDF5 with atomic commit and reshard-on-load.

Every rank writes its slices of the global tensors (and small per-rank blobs) into its own shard
file; rank 0 commits a manifest once all shards are durable, with no collective; readers assemble
any global box from the stored slices, whatever layout wrote them. See checkpoints/README.md.
Imports neither `hpcrl` nor `launch`; the slice algebra is `moe.slices.Box`.
"""

from .catalog import apply_retention, discard_newer, latest_pointer, latest_step, list_checkpoints
from .errors import (CheckpointError, CheckpointExistsError, CheckpointNotFoundError, CommitError,
                     CommitTimeoutError, CorruptCheckpointError)
from .manifest import FORMAT_VERSION, Manifest
from .reader import CheckpointReader, VerifyReport, open_checkpoint, verify
from .store import LocalFSStore, MemoryStore, ShardStore
from .writer import CheckpointWriter, SaveResult

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
    "verify",
]
