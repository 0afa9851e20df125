"""How many bytes a training forward's decoder layers leave for the backward: what activation
recomputation (trainer.recompute_*) trades for compute. Measured with autograd's saved-tensor hooks,
so it is exact and the same on any host (unlike a process's peak memory).

    with SavedActivations(policy.gpt) as saved:
        policy.train_step(...)
    saved.per_forward  # bytes per decoder-block forward (one per micro-batch and pipeline stage)
    saved.per_head     # bytes per model forward outside the decoder block: the embedding, the output
                       # layer and the loss's log-probs over the vocab (on the last stage)

`allocated_peak(profile.events())` is the peak of what is allocated at once, transients included.

A tensor counts once per storage, with the storage's size when the block's forward ends (outside
the block: when it is saved), and parameters not at all (autograd saves the weights a matmul needs,
which exist anyway). A recompute runs the layers again from inside the backward, not through the
block's forward: what it saves then lives for one chunk's backward only and is not counted; nor is
anything saved while a backward runs.
"""

from __future__ import annotations

from typing import Any

import torch


class SavedActivations:
    """Counts, per forward of each `TransformerBlock` in `model`, the bytes of the distinct non-parameter
    storages autograd saves for the backward while that forward runs."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.per_forward: list[int] = []
        self.per_head: list[int] = []
        self._storages: dict[int, Any] | None = None
        self._head: dict[int, int] = {}  # the model forward's storages outside the block: their bytes
        self._handles: list[Any] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._params: set[int] = set()

    def __enter__(self) -> SavedActivations:
        self._params = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        self._handles.append(self.model.register_forward_pre_hook(self._enter_model))
        for block in (m for m in self.model.modules() if type(m).__name__ == "TransformerBlock"):
            self._handles.append(block.register_forward_pre_hook(self._enter_block))
            self._handles.append(block.register_forward_hook(self._leave_block))
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
        self._close_head()
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _enter_model(self, *_: object) -> None:
        self._close_head()

    def _close_head(self) -> None:
        if self._head:
            self.per_head.append(sum(self._head.values()))
            self._head = {}

    def _enter_block(self, *_: object) -> None:
        self._storages = {}

    def _leave_block(self, *_: object) -> None:
        # at the block's end: an output that CheckpointWithoutOutput (layernorm, mla_up_proj) recomputes
        # in the backward has been freed by then (its storage resized to 0)
        assert self._storages is not None
        self.per_forward.append(sum(s.nbytes() for s in self._storages.values()))
        self._storages = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() in self._params or torch._C._current_graph_task_id() != -1:  # a backward's
            return t
        if self._storages is not None:
            self._storages[storage.data_ptr()] = storage
        else:
            self._head[storage.data_ptr()] = storage.nbytes()
        return t


def allocated_peak(events: Any) -> int:
    """The most bytes allocated at once, counted from the start, in a CPU profile's events
    (`torch.profiler.profile(profile_memory=True).events()`): every op's own allocations and frees and
    the ones outside ops ("[memory]"), in time order. Exact on any host for what the allocator is
    asked (what it keeps cached is not seen); transients inside an op that it frees itself are not."""
    deltas = sorted((e.time_range.start, e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage)
                    for e in events)
    now = top = 0
    for _, delta in deltas:
        now += delta
        top = max(top, now)
    return top
