"""N-d boxes: the slice algebra shared by resharding (moe/) and checkpoint loading (checkpoints/).

A `Box` is the rectangular region `offsets[d] <= i[d] < offsets[d] + shape[d]` of a tensor's
global index space. Layouts say which box of which tensor a rank holds; a plan or a loader
intersects boxes to find what to move or read.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod


@dataclass(frozen=True, slots=True)
class Box:
    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        assert len(self.offsets) == len(self.shape), (self.offsets, self.shape)
        assert all(s >= 0 for s in self.shape) and all(o >= 0 for o in self.offsets), self

    @staticmethod
    def full(shape: tuple[int, ...] | list[int]) -> Box:
        return Box((0,) * len(shape), tuple(shape))

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def end(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.shape))

    def intersect(self, other: Box) -> Box | None:
        """The common region, or None when the boxes do not overlap (or touch only at an edge)."""
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets))
        hi = tuple(min(a, b) for a, b in zip(self.end, other.end))
        if any(h <= l for l, h in zip(lo, hi)):
            return None
        return Box(lo, tuple(h - l for l, h in zip(lo, hi)))

    @property
    def index(self) -> tuple[slice, ...]:
        """Index into a tensor holding the whole global index space that selects this box."""
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.shape))

    def contains(self, other: Box) -> bool:
        return all(a <= b for a, b in zip(self.offsets, other.offsets)) and all(
            a >= b for a, b in zip(self.end, other.end))

    def relative_to(self, outer: Box) -> tuple[slice, ...]:
        """Index into a tensor holding `outer` that selects this box (which must lie inside it)."""
        assert outer.contains(self), (self, outer)
        return tuple(slice(o - oo, o - oo + s) for o, oo, s in zip(self.offsets, outer.offsets, self.shape))

    def split(self, axis: int, parts: int, index: int) -> Box:
        """The `index`-th of `parts` equal pieces along `axis` (the axis length must divide evenly)."""
        length = self.shape[axis]
        assert length % parts == 0, f"axis {axis} of {self} does not split into {parts}"
        step = length // parts
        offsets = list(self.offsets)
        shape = list(self.shape)
        offsets[axis] += index * step
        shape[axis] = step
        return Box(tuple(offsets), tuple(shape))
