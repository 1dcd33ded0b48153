"""A process-wide cap on how many pieces a ring call is split into (head groups, batch groups), for benchmarks and
tests: set in code (:meth:`SplitLimit.set`, :meth:`SplitLimit.forced`) or by an environment variable."""
from __future__ import annotations

import contextlib
import os
from typing import Iterator


class SplitLimit:
    """``at most n`` pieces per ring call (1: unsplit); unset: the caller's automatic choice."""

    def __init__(self, env_var: str, pieces: str):
        self.env_var, self.pieces = env_var, pieces
        self._forced: int | None = None

    def set(self, limit: int | None) -> None:
        if limit is not None and int(limit) < 1:
            raise ValueError(f"{self.pieces} must be at least 1, got {limit}")
        self._forced = None if limit is None else int(limit)

    @contextlib.contextmanager
    def forced(self, limit: int | None) -> Iterator[None]:
        previous = self._forced
        self.set(limit)
        try:
            yield
        finally:
            self.set(previous)

    def requested(self) -> int | None:
        """The cap set in code, else the environment variable's, else None."""
        if self._forced is not None:
            return self._forced
        value = os.environ.get(self.env_var)
        if not value:
            return None
        try:
            limit = int(value)
        except ValueError:
            limit = 0
        if limit < 1:
            raise ValueError(f"{self.env_var} must be a positive integer, got {value!r}")
        return limit
