"""Imports withheld for a moment, as if the modules were not installed: for a library that
imports what kafka2pg never uses from it when it finds it (pyarrow's pandas in a Spark task,
GX's optional extras in the gate), and works without it."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.abc import MetaPathFinder
from typing import Any


@contextmanager
def withheld(*names: str) -> Iterator[None]:
    """Inside the block, this thread's imports of `names` (and their submodules) raise
    ModuleNotFoundError; other threads import as usual, and so does this one afterwards."""
    finder = _Withheld(names)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)


class _Withheld(MetaPathFinder):
    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.thread = threading.get_ident()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        named = any(fullname == n or fullname.startswith(n + ".") for n in self.names)
        if named and threading.get_ident() == self.thread:
            raise ModuleNotFoundError(f"No module named {fullname!r} (withheld here by kafka2pg)", name=fullname)
        return None
