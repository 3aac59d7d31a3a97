"""Writing a file atomically: the whole new content or the old file, never half of one."""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import IO, Iterator


@contextlib.contextmanager
def atomic_file(path: str, binary: bool = False) -> Iterator[IO]:
    """Open a temp file beside `path` for writing; on a clean exit it is flushed, fsynced and renamed over `path`,
    on an error removed (`path` untouched)."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp_path = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.splitext(path)[1])
    replaced = False
    try:
        with os.fdopen(fd, "wb" if binary else "w") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
        replaced = True
    finally:
        if not replaced:
            os.unlink(tmp_path)
