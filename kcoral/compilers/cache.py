# -*- test-case-name: tests.unit.test_compilers -*-
"""
L{CompileCache}: compiled module images on disk, keyed by everything that
determines the output.

Layout: one file per entry, C{<directory>/<sha256 hex>.bin}, written
atomically (temporary file + C{os.replace}) with mode 0600 in a 0700
directory. Each file starts with a small header (magic, the seconds the
original compile took, so a hit can report the time it saved, and the
image's sha256, checked on every read) followed by the image. Eviction is least-recently-used by mtime: a hit touches the file,
and after each C{put} the oldest files go until the total fits
C{capacity_bytes}. Several processes may share a directory.

The key (L{cache_key}) and the header carry format versions
(L{KEY_VERSION}, C{_MAGIC}); an entry of an older format is never read,
and ages out under the LRU.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
import threading
from collections.abc import Mapping, Sequence

import attrs

__all__ = ["CompileCache", "cache_key"]

#: Entries of older formats read as missing.  C{KCC3}/key version 2 since
#: issue 32, item 1: entries written before it may hold an image a compile
#: forged under another request's key, so none of them is served.
_MAGIC = b"KCC3"
#: Part of every key: bumped when old entries must not be served.
KEY_VERSION = 2

_HEADER = struct.Struct("<4sd32s")  # magic, compile seconds, sha256 of the image
_SUFFIX = ".bin"


def cache_key(
    source: str,
    arch: str,
    options: Sequence[str],
    backend: str,
    toolchain: Mapping[str, str] | str,
) -> str:
    """
    The cache key: sha256 over a canonical JSON encoding of the inputs.

    @param toolchain: the backend's L{versions()
        <kcoral.compilers.interfaces.ICompilerBackend.versions>} (or a string).
    @return: 64 lowercase hex digits.
    """
    if isinstance(toolchain, Mapping):
        toolchain = json.dumps(dict(toolchain), sort_keys=True)
    blob = json.dumps(
        {
            "v": KEY_VERSION,
            "source": source,
            "arch": arch,
            "options": list(options),
            "backend": backend,
            "toolchain": toolchain,
        },
        sort_keys=True,
        ensure_ascii=False,
    )
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


@attrs.define(eq=False)
class CompileCache:
    """
    A size-bounded, on-disk LRU cache of module images.

    @ivar hits: lookups answered from disk.
    @ivar misses: lookups that found nothing.
    @ivar saved_seconds: sum of the original compile times of the hits.
    """

    directory: str
    capacity_bytes: int = 1 << 30
    hits: int = attrs.field(default=0, init=False)
    misses: int = attrs.field(default=0, init=False)
    saved_seconds: float = attrs.field(default=0.0, init=False)
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        os.makedirs(self.directory, mode=0o700, exist_ok=True)

    def _path(self, key: str) -> str:
        if len(key) != 64 or not all(c in "0123456789abcdef" for c in key):
            raise ValueError(f"not a cache key: {key!r}")
        return os.path.join(self.directory, key + _SUFFIX)

    def read(self, key: str) -> tuple[bytes, float] | None:
        """
        The image stored under C{key} and its compile seconds, when the entry
        is whole: its header's sha256 matches the image (a torn or altered
        entry reads as missing).  Counts nothing.
        """
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            return None
        if len(data) < _HEADER.size or data[:4] != _MAGIC:
            return None
        _, seconds, digest = _HEADER.unpack_from(data)
        image = data[_HEADER.size :]
        if hashlib.sha256(image).digest() != digest:
            return None
        return image, seconds

    def get(self, key: str) -> bytes | None:
        """
        @return: the image stored under C{key}, or C{None}; counts a hit or a miss.
        """
        entry = self.read(key)
        if entry is None:
            self.count_miss()
            return None
        image, seconds = entry
        self.touch(key)
        self.count_hit(seconds)
        return image

    def touch(self, key: str) -> None:
        """Mark the entry under C{key} most recently used (errors ignored)."""
        try:
            os.utime(self._path(key))
        except OSError:
            pass

    def count_hit(self, seconds: float) -> None:
        """Count a hit found elsewhere (the server looked it up) that saved C{seconds}."""
        with self._lock:
            self.hits += 1
            self.saved_seconds += seconds

    def count_miss(self) -> None:
        """Count a miss found elsewhere (the server compiled it)."""
        with self._lock:
            self.misses += 1

    def put(self, key: str, image: bytes, compile_seconds: float = 0.0) -> None:
        """
        Store C{image} under C{key} atomically, then evict down to capacity.
        Errors writing the cache are swallowed: it is only a cache.
        """
        path = self._path(key)
        image = bytes(image)
        digest = hashlib.sha256(image).digest()
        payload = _HEADER.pack(_MAGIC, float(compile_seconds), digest) + image
        if len(payload) > self.capacity_bytes:
            return
        try:
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-", suffix=_SUFFIX)
        except OSError:
            return
        try:
            with os.fdopen(fd, "wb") as f:  # mkstemp files are 0600
                f.write(payload)
            os.replace(tmp, path)
        except OSError:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return
        self.evict()

    def entries(self) -> list[tuple[float, int, str]]:
        """@return: C{(mtime, size, path)} of each stored image, oldest first."""
        found = []
        try:
            with os.scandir(self.directory) as it:
                for entry in it:
                    if entry.name.endswith(_SUFFIX) and not entry.name.startswith("."):
                        try:
                            st = entry.stat()
                        except OSError:
                            continue
                        found.append((st.st_mtime, st.st_size, entry.path))
        except OSError:
            return []
        found.sort()
        return found

    def size_bytes(self) -> int:
        """@return: bytes used by stored images."""
        return sum(size for _, size, _ in self.entries())

    def evict(self) -> None:
        """Remove least recently used images until the total fits the capacity."""
        entries = self.entries()
        total = sum(size for _, size, _ in entries)
        for _, size, path in entries:
            if total <= self.capacity_bytes:
                break
            try:
                os.unlink(path)
            except OSError:
                continue
            total -= size

    def stats(self) -> dict[str, object]:
        """@return: counters for /health and C{compile_stats()}."""
        with self._lock:
            return {
                "hits": self.hits,
                "misses": self.misses,
                "saved_seconds": round(self.saved_seconds, 6),
            }
