"""Durable file operations: a folder replaced only once its successor is complete, files and
folder entries flushed to disk, and disk-full errors that name the path."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path


class StorageError(RuntimeError):
    """Writing failed (disk full, permissions); the message names the path and what to do."""

    def __init__(self, message: str, error_number: int | None) -> None:
        super().__init__(message)
        self.errno = error_number


def storage_error(err: OSError, path: Path, intact: str) -> StorageError:
    """A one-line error for a failed write of `path`; `intact` says what was kept."""
    if err.errno == errno.ENOSPC:
        what = f"disk full while writing {path}: free space on that filesystem"
    elif err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        what = f"no permission to write {path}: pick a writable --output-dir"
    else:
        what = f"writing {path} failed ({err.strerror or err})"
    return StorageError(f"{what}; {intact}", err.errno)


def output_dir_problem(path: Path) -> str | None:
    """Why `path` cannot hold a run's outputs, or None. The folder is created (with its parents)
    and a nameless file written in it: permission bits do not tell (root, read-only mounts, /proc)."""
    if path.exists() and not path.is_dir():
        return "is a file, not a folder"
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        return f"cannot be created or written ({err.strerror or err})"
    return None


def output_file_problem(path: Path) -> str | None:
    """Why a file cannot be written at `path`, or None: it is a folder, or its folder cannot hold it."""
    return "is a folder" if path.is_dir() else output_dir_problem(path.parent)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Flush a folder's entries (renames, new files) so they survive a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_durably(path: Path, text: str) -> None:
    """Write a temp file, flush it, rename it over `path`: readers see the old or the new file."""
    write_lines_durably(path, [text])


def write_lines_durably(path: Path, lines: Iterable[str]) -> None:
    """write_text_durably for text made piece by piece: a large file is never held whole."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(lines)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def staging_dir(final: Path) -> Path:
    """A fresh hidden folder beside `final` to build its successor in (mode 0755 less umask,
    not mkdtemp's 0700: exported folders are read by other users and serving engines)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)
    return staging


def replace_dir(staging: Path, final: Path) -> None:
    """Move a complete `staging` folder to `final`. An old `final` is moved aside first and
    deleted only after the new one is in place, so one complete folder exists at every moment
    but the two renames' instant."""
    for root, _, files in os.walk(staging):
        for name in files:
            fsync_file(Path(root) / name)
    if final.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
        os.rename(final, trash / "old")
        os.rename(staging, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(staging, final)
    fsync_dir(final.parent)
