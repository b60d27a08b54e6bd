"""Writing a file atomically, with the permissions a plain ``open(path, "w")`` gives it."""

from __future__ import annotations

import os
import secrets


def write_atomic(path: str | os.PathLike, text: str) -> str:
    """Write ``text`` to ``path`` through a temporary file in the same folder renamed over it, so a reader
    sees the old file or the new one, never half of one. The temporary file is created with mode 0666 less
    the umask, as ``open()`` creates files (``tempfile.mkstemp`` would make it 0600). Returns the path."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path
