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
    _install()
    before = getattr(_withheld, "names", ())
    _withheld.names = (*before, *names)
    try:
        yield
    finally:
        _withheld.names = before


_withheld = threading.local()  # .names: what this thread's imports may not find now
_installing = threading.Lock()


class _Withheld(MetaPathFinder):
    """One finder for the process, installed once and never removed: a thread importing while
    another changed `sys.meta_path` in place could skip a finder and miss an installed module.
    It consults the importing thread's names only."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        names = getattr(_withheld, "names", ())
        if any(fullname == n or fullname.startswith(n + ".") for n in names):
            raise ModuleNotFoundError(f"No module named {fullname!r} (withheld here by kafka2pg)", name=fullname)
        return None


def _install() -> None:
    with _installing:
        if not any(isinstance(f, _Withheld) for f in sys.meta_path):
            # A new list, not an insert into the one an import in another thread may be walking.
            sys.meta_path = [_Withheld(), *sys.meta_path]
