"""Files kafka2pg writes for others to read (quality reports, the local stack's state): whole or
not at all, so a process killed while writing leaves the previous file, never half of one."""

from __future__ import annotations

import os
from pathlib import Path


def write_whole(path: Path, text: str) -> None:
    """Write `text` (UTF-8) to a temporary file beside `path`, then rename it over `path`."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        partial.write_text(text, encoding="utf-8")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
