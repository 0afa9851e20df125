"""What a built-in algorithm declares about its config keys, read without importing the algorithm.

Each built-in module hpcrl/dataflows/<name>.py declares, as Python literals at its top level:

    DEFAULTS = {"clip_eps": 3e-4, ...}   the algorithm.* keys of PER_ALGORITHM_KEYS it reads, with the
                                         value each takes when the job leaves it unset (null)
    FIXED = ("loss_agg",)                keys of DEFAULTS whose value the algorithm never changes
                                         (its definition); a job may only repeat that value

A key of PER_ALGORITHM_KEYS missing from DEFAULTS is one the algorithm never reads; `clip_eps_high`
is read by every algorithm that reads `clip_eps` (unset: DEFAULTS' value, else clip_eps).
`hpcrl.config.schema.AlgorithmConfig` resolves the unset keys with these declarations when it is
built, and `hpcrl validate` refuses keys an algorithm does not read. The config package stays
torch-free (`hpcrl validate` takes ~0.25 s; importing a dataflow module, and so torch, ~2 s), so the
declarations are read from the module's source with `ast.literal_eval`; a unit test checks that they
equal the imported modules' attributes.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path
from types import MappingProxyType
from typing import Any

PER_ALGORITHM_KEYS = ("clip_eps", "clip_eps_high", "kl_estimator", "loss_agg")
"""algorithm.* keys whose default belongs to the algorithm (the schema's default is null)."""

GENERIC_DEFAULTS = MappingProxyType({"clip_eps": 0.2, "kl_estimator": "k3", "loss_agg": "token-mean"})
"""The defaults of a user's algorithm module (it may read any key; clip_eps_high: clip_eps)."""

_HERE = Path(__file__).resolve().parent


@functools.cache
def declared(name: str) -> tuple[MappingProxyType, tuple[str, ...]]:
    """(DEFAULTS, FIXED) of algorithm `name`: a built-in's declarations, or (GENERIC_DEFAULTS, ())
    for any other name (a user's module)."""
    path = _HERE / f"{name}.py"
    if not name.isidentifier() or name.startswith("_") or not path.is_file():
        return GENERIC_DEFAULTS, ()
    found: dict[str, Any] = {}
    for node in ast.parse(path.read_text(), str(path)).body:  # top-level `NAME = <literal>` lines
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        target = node.targets[0]
        if isinstance(target, ast.Name) and target.id in ("DEFAULTS", "FIXED"):
            found[target.id] = ast.literal_eval(node.value)
    defaults, fixed = found.get("DEFAULTS"), tuple(found.get("FIXED", ()))
    assert isinstance(defaults, dict), f"{path} declares no DEFAULTS literal"
    assert set(defaults) <= set(PER_ALGORITHM_KEYS) and set(fixed) <= set(defaults), (path, defaults, fixed)
    return MappingProxyType(defaults), fixed
