"""Files kafka2pg writes for others to read (quality reports, the local stack's state): whole or
not at all, so a process killed while writing leaves the previous file, never half of one."""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path


def write_whole(path: Path, text: str) -> None:
    """Write `text` (UTF-8) to a temporary file beside `path` (beside the file a symlink names),
    then rename it over that file, which keeps its permissions (a new one gets the umask's)."""
    target = path.resolve() if path.is_symlink() else path
    partial = target.with_name(f".{target.name}.{secrets.token_hex(6)}.partial")  # one per writer
    try:
        descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(descriptor, "w", encoding="utf-8") as out:
            out.write(text)
        try:
            os.chmod(partial, stat.S_IMODE(target.stat().st_mode))
        except FileNotFoundError:
            pass
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
