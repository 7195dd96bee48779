"""One rule for the settings the offloader tunes as it runs (how many layers to read ahead,
how many to keep): one step less after enough clean rounds in a row, one step more on a
stall, and more patience after a step down that stalled."""

from __future__ import annotations


class StepControl:
    """Decides when a setting may go one step down.

    Args:
        patience: clean rounds in a row before a step down.
        limit: the most patience a run of failed step downs can build up.
    """

    __slots__ = ("clean", "limit", "lowered", "patience")

    def __init__(self, patience: int, limit: int = 64) -> None:
        self.patience, self.limit = patience, limit
        self.clean = 0
        self.lowered = False  # the last round stepped down

    def stall(self) -> None:
        """A round that waited: the caller steps up. If it had just stepped down, the next
        step down waits twice as long."""
        if self.lowered:
            self.patience = min(self.patience * 2, self.limit)
        self.lowered = False
        self.clean = 0

    def tight(self) -> None:
        """A round that did not wait, but would have with one step less."""
        self.lowered = False
        self.clean = 0

    def quiet(self, can_lower: bool = True) -> bool:
        """A clean round; True when the caller should step down now."""
        self.lowered = False
        self.clean += 1
        if can_lower and self.clean >= self.patience:
            self.clean = 0
            self.lowered = True
            return True
        return False

    def idle(self) -> None:
        """A round that says nothing either way."""
        self.lowered = False
