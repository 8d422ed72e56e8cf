"""Small cache files under ``$XDG_CACHE_HOME/devmap_shims``, read and written without trusting the disk.

The cache is read in processes that enable the shims, pip and services included, possibly as root
with another user's ``HOME`` or with a shared ``XDG_CACHE_HOME``. So:

* the folder is ``$XDG_CACHE_HOME/devmap_shims`` when that variable is an absolute path (the XDG
  specification says to ignore a relative one), else ``$HOME/.cache/devmap_shims`` when ``HOME``
  is absolute; otherwise there is no cache. It is made only where ``HOME`` (or the parent of
  ``XDG_CACHE_HOME``) exists: ``HOME=/nonexistent`` is never created;
* reading opens without following a link and without blocking, and takes only a regular file of
  this user no larger than :data:`MAX_BYTES`: a FIFO, ``/dev/zero`` or a huge file is ignored;
* a file is used only when its header names this format and key, every line is one the caller
  accepts, and its last line holds the count and hash of the lines before it (a torn or foreign
  file is ignored, and rewritten);
* writing goes to a fresh file made with ``mkstemp`` (exclusive create, mode 0600) in a folder of
  this user that nobody else can write to, then renamed over the old name, which replaces a link
  planted there instead of following it. When the folder is not safe nothing is written.

Every failure is silent: the caller computes the data again.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False  # typing only for type checkers: see devmap_shims/shims/record.py
if TYPE_CHECKING:
    from typing import Callable, List, Optional

MAX_BYTES = 1 << 20


def cache_dir() -> Optional[str]:
    """The cache folder, or None when the environment names no usable one."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        home = os.environ.get("HOME", "") if "HOME" in os.environ else os.path.expanduser("~")
        if not home or not os.path.isabs(home) or home == os.sep:
            return None
        base = os.path.join(home, ".cache")
    return os.path.join(base, "devmap_shims")


def fnv1a(text: str) -> str:
    """A 64-bit FNV-1a hash of ``text``, as 16 hex digits (a checksum, not a security measure)."""
    value = 0xCBF29CE484222325
    for byte in text.encode("utf-8", "surrogateescape"):
        value = ((value ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{value:016x}"


def _end_line(lines: List[str]) -> str:
    return f"end {len(lines)} {fnv1a(chr(10).join(lines))}"


def read_regular_file(path: str, limit: int, *, follow_links: bool = True, own: bool = False,
                      whole: bool = True) -> Optional[bytes]:
    """The bytes of the regular file at ``path``, or None: opened without blocking, so a FIFO, a
    device (``/dev/zero``, ``/dev/stdin``) or a folder is never read. With ``whole``, a file over
    ``limit`` bytes gives None; without, its first ``limit`` bytes. ``follow_links=False`` refuses
    a link, ``own=True`` a file of another user."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    if not follow_links:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return None
    try:
        import stat

        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or (whole and info.st_size > limit):
            return None
        if own and hasattr(os, "geteuid") and info.st_uid != os.geteuid():
            return None
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit and whole:
            return None
        return b"".join(chunks)[:limit]
    except OSError:
        return None
    finally:
        os.close(fd)


def read(name: str, header: str, accept: Callable[[str], bool]) -> Optional[List[str]]:
    """The lines stored under ``name`` after ``header`` (format and key), or None when there is no
    such file or it cannot be trusted."""
    folder = cache_dir()
    if folder is None:
        return None
    data = read_regular_file(os.path.join(folder, name), MAX_BYTES, follow_links=False, own=True)
    if data is None:
        return None
    text = data.decode("utf-8", "surrogateescape")  # as written: a non-UTF-8 path keeps its bytes
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    head = header.split("\n")
    if len(lines) <= len(head) or lines[: len(head)] != head or lines[-1] != _end_line(lines[:-1]):
        return None
    body = lines[len(head):-1]
    if not all(accept(line) for line in body):
        return None
    return body


def _safe_folder(folder: str) -> bool:
    """Whether ``folder`` is a real folder of this user that nobody else may write to (made so if
    it does not exist). A folder is made only inside a folder of this user: a ``HOME`` that names
    no folder (``/nonexistent`` for system users) is never created, and root running with another
    user's ``HOME`` (``sudo -E``, a service) makes no root-owned ``~/.cache`` that the user could
    not write to afterwards."""
    import stat

    if not os.path.lexists(folder):
        base = os.path.dirname(folder)
        if not os.path.isdir(base) and not _make_inside_own(base, 0o777):
            return False
        if not _make_inside_own(folder, 0o700):
            return False
    try:
        info = os.lstat(folder)
    except OSError:
        return False
    return _own_folder(info) and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _own_folder(info: os.stat_result) -> bool:
    """Whether ``info`` (an ``os.stat`` result) is that of a folder of this user."""
    import stat

    return stat.S_ISDIR(info.st_mode) and not (hasattr(os, "geteuid") and info.st_uid != os.geteuid())


def _make_inside_own(path: str, mode: int) -> bool:
    """Make the folder ``path`` when the folder it goes in (links followed) belongs to this user."""
    try:
        if not _own_folder(os.stat(os.path.dirname(path))):
            return False
    except OSError:
        return False
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        pass
    except OSError:
        return False
    return True


def write(name: str, header: str, lines: List[str]) -> bool:
    """Store ``lines`` under ``name`` after ``header``; False when nothing could be written safely."""
    folder = cache_dir()
    if folder is None or not _safe_folder(folder):
        return False
    content = header.split("\n") + list(lines)
    text = "\n".join(content + [_end_line(content)]) + "\n"
    import tempfile

    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
    except OSError:
        return False
    try:
        # surrogateescape: a path read from a non-UTF-8 file system name goes back as its bytes
        with os.fdopen(fd, "w", encoding="utf-8", errors="surrogateescape") as handle:
            handle.write(text)
        os.replace(tmp, os.path.join(folder, name))  # atomic; replaces a link, never follows it
        return True
    except (OSError, ValueError):
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False
