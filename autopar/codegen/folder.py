"""An output folder written all at once: ``with staged(out_dir) as folder: <write into folder>``.

Everything is written into a temporary folder beside ``out_dir`` (``.<name>.<random>.partial``, on
the same file system, so a rename moves it). When the block ends without an error the files reach
``out_dir`` by renames only: a new folder is renamed into place whole; into an existing one (a
re-emit) each written file is renamed over its old version (``os.replace``), and what else it holds
(a checkpoint, the user's own modules) is kept. When the block raises, the temporary folder is
removed and ``out_dir`` is as it was (or still absent): a failure midway never leaves a half-written
folder.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from typing import Iterator

from ..errors import ConfigError


@contextlib.contextmanager
def staged(out_dir: str | os.PathLike) -> Iterator[str]:
    """The temporary folder to write into; its files are moved to ``out_dir`` when the block succeeds."""
    out = os.path.abspath(os.fspath(out_dir))
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"the output folder {os.fspath(out_dir)!r} exists and is not a folder: pass another path")
    parent, name = os.path.split(out)
    os.makedirs(parent, exist_ok=True)
    temp = os.path.join(parent, f".{name}.{secrets.token_hex(4)}.partial")
    os.mkdir(temp)   # the mode a folder gets here (umask), as out_dir would
    try:
        yield temp
        _publish(temp, out)
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def _publish(temp: str, out: str) -> None:
    try:
        os.rename(temp, out)   # out_dir did not exist (or was empty): the whole folder at once
        return
    except OSError:
        if not os.path.isdir(out):
            raise
    for entry in sorted(os.listdir(temp)):
        target = os.path.join(out, entry)
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target)   # a folder the previous emit wrote under this name
        os.replace(os.path.join(temp, entry), target)
