# -*- test-case-name: tests.unit.test_cache -*-
"""
Blob caches: an in-process LRU for tensors, bytes and libraries, a shared
on-disk cache for file uploads, and the facade that resolves a request's
blobs against both (server spec §7, protocol §5).

Both caches are keyed by the lowercase SHA-256 hex digest of the raw bytes and
only ever hold uploaded bytes.  Caching is an optimisation: every failure here
turns into a miss (the client resends) or a skipped write, never an error for
the request.

Threading:

  - L{MemoryBlobCache} belongs to the reactor thread.  It takes no locks and
    every method is O(1) (amortised), with no I/O.
  - L{DiskFileCache} blocks on file I/O; call it from a thread pool.  It is
    thread-safe (a L{threading.Lock} plus an exclusive C{flock} on the C{v1}
    directory, which also serialises other server processes sharing it).  Its
    C{on_event} callback runs in the calling thread.
  - L{BlobStore.resolve} runs on the reactor and sends the disk work to the
    thread pool with L{deferToThreadPool}.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import secrets
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from pathlib import Path

import attrs
from twisted.internet.interfaces import IReactorFromThreads
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.threadpool import ThreadPool

from kcoral.ipc.shared import SharedBuffer
from kcoral.wire.program import MEMORY_KINDS, is_digest

#: Upload kind whose blobs live in the disk cache.
FILE_KIND = "file"

#: Name of the versioned layout directory under the disk cache root.
LAYOUT_VERSION = "v1"

#: Prefix of the temporary files a disk-cache write renames into place.
TMP_PREFIX = ".tmp-"

_HEX = frozenset("0123456789abcdef")
_CHUNK = 1024 * 1024

#: C{on_event(name, **fields)}: receives C{cache_hit}, C{cache_miss},
#: C{cache_stored}, C{cache_evicted} and C{cache_error}.
EventCallback = Callable[..., None]


def _no_event(name: str, **fields: object) -> None:
    """Default event callback: ignore everything."""


# ---------------------------------------------------------------------------
# Memory cache


class Pin:
    """
    A request's hold on some memory-cache entries.

    While a pin is held its entries are never evicted.  L{release} drops the
    hold exactly once; later calls do nothing.  A pin is also a context
    manager that releases on exit.

    @ivar digests: the entries this pin holds (those present when pinned).
    """

    def __init__(self, cache: MemoryBlobCache | None, digests: tuple[str, ...]) -> None:
        self._cache = cache
        self.digests = digests

    @classmethod
    def empty(cls) -> Pin:
        """A pin that holds nothing."""
        return cls(None, ())

    @property
    def released(self) -> bool:
        """C{True} once L{release} has been called (or if nothing was held)."""
        return self._cache is None

    def release(self) -> None:
        """Unpin every held entry; idempotent."""
        cache, self._cache = self._cache, None
        if cache is not None:
            cache._unpin(self.digests)

    def __enter__(self) -> Pin:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<Pin {len(self.digests)} entries{' released' if self.released else ''}>"


class MemoryBlobCache:
    """
    Least-recently-used cache of blob bytes, bounded by total size.

      - L{get} and re-L{put} make an entry the most recently used.
      - Quarter rule: an object strictly larger than C{capacity_bytes // 4} is
        not stored (the request that supplied it still uses its own copy).
      - Pinned entries (see L{pin}) are never evicted, so the cache may stay
        over budget while they are held (pins only hold entries already
        present, so this happens when C{capacity_bytes} is lowered under
        them; a newcomer that cannot fit beside pinned entries is evicted
        at once).  A pinned entry counts as in use: when
        its last pin is released it becomes the most recently used entry, and
        eviction runs again.

    Reactor thread only; no locks, no I/O.

    @ivar hits: L{get} calls that found their entry.
    @ivar misses: L{get} calls that did not.
    @ivar evictions: entries removed to respect the budget.
    @ivar stored_bytes: total bytes of all new entries ever stored.
    """

    def __init__(
        self,
        capacity_bytes: int,
        on_event: EventCallback = _no_event,
        max_shared_entries: int | None = None,
    ) -> None:
        self.capacity_bytes = capacity_bytes
        self._on_event = on_event
        self._max_shared_entries = max_shared_entries
        self.shared_entries = 0
        # Unpinned entries, oldest first.
        self._lru: OrderedDict[str, bytes | SharedBuffer] = OrderedDict()
        # Pinned entries: digest -> (data, reference count).
        self._pinned: dict[str, tuple[bytes | SharedBuffer, int]] = {}
        self._size = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.stored_bytes = 0

    @property
    def max_shared_entries(self) -> int:
        """
        Entries kept as sealed shared buffers (one descriptor each) at most;
        past it a newcomer is stored as bytes, so a cache of many small
        blobs cannot use up the server's descriptors.  By default a quarter
        of the open-file limit, read at the first store (after start-up
        raised the limit).
        """
        if self._max_shared_entries is None:
            self._max_shared_entries = _default_shared_entries()
        return self._max_shared_entries

    @property
    def max_object_bytes(self) -> int:
        """The largest object the quarter rule admits."""
        return self.capacity_bytes // 4

    @property
    def size_bytes(self) -> int:
        """Total bytes held, pinned entries included."""
        return self._size

    @property
    def count(self) -> int:
        """Number of entries held, pinned entries included."""
        return len(self._lru) + len(self._pinned)

    def __len__(self) -> int:
        return self.count

    def __contains__(self, digest: object) -> bool:
        """Presence test; does not touch recency or the counters."""
        return digest in self._lru or digest in self._pinned

    def get(self, digest: str) -> bytes | SharedBuffer | None:
        """
        The bytes stored under C{digest}, or C{None}.  A hit makes the entry
        the most recently used.
        """
        data = self._lru.get(digest)
        if data is not None:
            self._lru.move_to_end(digest)
        else:
            held = self._pinned.get(digest)
            data = held[0] if held is not None else None
        if data is None:
            self.misses += 1
            self._on_event("cache_miss", cache="memory", digest=digest)
            return None
        self.hits += 1
        self._on_event("cache_hit", cache="memory", digest=digest, size=len(data))
        return data

    def put(self, digest: str, data: bytes | SharedBuffer) -> bool:
        """
        Store C{data} under C{digest} (the caller has checked the digest
        matches).  An entry already present just becomes the most recently
        used.

        @return: whether the entry is in the cache afterwards.
        @raise ValueError: C{digest} is not a lowercase SHA-256 hex digest.
        """
        if not is_digest(digest):
            raise ValueError(f"not a lowercase SHA-256 digest: {digest!r}")
        if digest in self._lru:
            self._lru.move_to_end(digest)
            return True
        if digest in self._pinned:
            return True
        if len(data) > self.max_object_bytes:
            return False
        if isinstance(data, SharedBuffer) and self.shared_entries < self.max_shared_entries:
            # A sealed shared buffer is kept as it is: workers get its
            # descriptor, no copy; its bytes can never change.
            self.shared_entries += 1
        elif isinstance(data, SharedBuffer):
            data = data.tobytes()
        else:
            data = bytes(data)
        self._lru[digest] = data
        self._size += len(data)
        self.stored_bytes += len(data)
        self._on_event("cache_stored", cache="memory", digest=digest, size=len(data))
        self._evict()
        return digest in self

    def pin(self, digests: Iterable[str]) -> Pin:
        """
        Pin every entry of C{digests} that is present (duplicates count once).
        Absent digests are ignored.  Pins are reference counted, so several
        requests may pin the same entry.
        """
        held = []
        for digest in dict.fromkeys(digests):
            data = self._lru.pop(digest, None)
            if data is not None:
                self._pinned[digest] = (data, 1)
            elif digest in self._pinned:
                data, refs = self._pinned[digest]
                self._pinned[digest] = (data, refs + 1)
            else:
                continue
            held.append(digest)
        if not held:
            return Pin.empty()
        return Pin(self, tuple(held))

    def pin_count(self, digest: str) -> int:
        """How many pins hold C{digest} (0 when unpinned or absent)."""
        held = self._pinned.get(digest)
        return held[1] if held is not None else 0

    def _unpin(self, digests: tuple[str, ...]) -> None:
        for digest in digests:
            data, refs = self._pinned[digest]
            if refs > 1:
                self._pinned[digest] = (data, refs - 1)
            else:
                del self._pinned[digest]
                self._lru[digest] = data
        self._evict()

    def _evict(self) -> None:
        """Drop the oldest unpinned entries until within capacity."""
        while self._size > self.capacity_bytes and self._lru:
            digest, data = self._lru.popitem(last=False)
            self._size -= len(data)
            if isinstance(data, SharedBuffer):
                self.shared_entries -= 1
            self.evictions += 1
            self._on_event("cache_evicted", cache="memory", digest=digest, size=len(data))


def _default_shared_entries() -> int:
    """A quarter of the soft limit on open files (a thousand where unknown)."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return 1024
    if soft == getattr(resource, "RLIM_INFINITY", -1) or soft <= 0:
        return 1 << 16
    return max(16, soft // 4)


# ---------------------------------------------------------------------------
# Disk cache


class _Mismatch(Exception):
    """Stored bytes do not hash to their name."""


class DiskFileCache:
    """
    Persistent cache of file-upload blobs, shared by every server process
    using the same directory (server spec §7.2).

    Layout: C{<directory>/v1/<first two hex>/<digest>}; directories are made
    0700 and files 0600.  The filesystem is the index.  Writes go to
    C{<shard>/.tmp-<random hex>} and are renamed into place, under an
    exclusive C{flock} on C{v1}.  Reads refuse symlinks and non-regular files,
    re-hash the content (a mismatch is a miss and the file is removed) and
    bump the mtime, so eviction (oldest mtime first) approximates LRU.

    Disabled when C{directory} is C{None} or C{capacity_mbytes} is not
    positive: every method is then a cheap miss or no-op.

    Every method blocks on I/O (call them from a thread pool), none raises on
    an I/O error: failures are reported as C{cache_error} events and become
    misses or skipped writes.  The constructor does no I/O; call L{evict} once
    at startup.
    """

    def __init__(
        self,
        directory: Path | str | None,
        capacity_mbytes: int,
        on_event: EventCallback = _no_event,
    ) -> None:
        if directory is None or str(directory) == "":
            self.directory: Path | None = None
        else:
            self.directory = Path(directory).expanduser().absolute()
        self.capacity_bytes = max(capacity_mbytes, 0) * 1024 * 1024
        self._on_event = on_event
        self._lock = threading.Lock()
        self._stats_lock = threading.Lock()
        # Bytes this process believes are stored; None until the first scan.
        self._tally: int | None = None
        self.hits = 0
        self.misses = 0
        self.errors = 0
        self.evictions = 0
        self.stored_bytes = 0

    @property
    def enabled(self) -> bool:
        """Whether the cache stores anything at all."""
        return self.directory is not None and self.capacity_bytes > 0

    @property
    def root(self) -> Path | None:
        """The C{v1} directory, or C{None} when disabled."""
        if not self.enabled:
            return None
        assert self.directory is not None
        return self.directory / LAYOUT_VERSION

    @property
    def tally_bytes(self) -> int | None:
        """This process's estimate of the stored total (C{None} before a scan)."""
        return self._tally

    def path_for(self, digest: str) -> Path | None:
        """Where C{digest} is stored, or C{None} when disabled or malformed."""
        root = self.root
        if root is None or not is_digest(digest):
            return None
        return root / digest[:2] / digest

    # -- reading

    def get(self, digest: str) -> bytes | None:
        """The verified bytes of C{digest}, or C{None} on a miss."""
        result = self._read(digest, keep=True)
        return result[1] if result is not None else None

    def get_path(self, digest: str) -> Path | None:
        """
        The path of a verified copy of C{digest}, or C{None} on a miss.  The
        file may be evicted (by any process) after this returns; hard-link or
        open it promptly.
        """
        result = self._read(digest, keep=False)
        return result[0] if result is not None else None

    def __contains__(self, digest: object) -> bool:
        """Cheap presence test (no verification, no mtime bump)."""
        path = self.path_for(digest) if isinstance(digest, str) else None
        if path is None:
            return False
        try:
            return stat.S_ISREG(os.lstat(path).st_mode)
        except OSError:
            return False

    def _read(self, digest: str, keep: bool) -> tuple[Path, bytes | None] | None:
        if not self.enabled:
            return None
        path = self.path_for(digest)
        if path is None:
            self._miss(digest)
            return None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            self._miss(digest)
            return None
        except OSError as e:
            reason = "symlink" if e.errno == errno.ELOOP else "open"
            self._error(reason, e, digest=digest)
            self._miss(digest)
            return None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                self._error("not a regular file", None, digest=digest)
                self._miss(digest)
                return None
            hasher = hashlib.sha256()
            chunks: list[bytes] = []
            while chunk := os.read(fd, _CHUNK):
                hasher.update(chunk)
                if keep:
                    chunks.append(chunk)
            if hasher.hexdigest() != digest:
                self._error("hash mismatch", None, digest=digest)
                self._remove_bad(path, info)
                self._miss(digest)
                return None
            try:
                os.utime(fd)
            except OSError as e:
                self._error("utime", e, digest=digest)
        except OSError as e:
            self._error("read", e, digest=digest)
            self._miss(digest)
            return None
        finally:
            os.close(fd)
        with self._stats_lock:
            self.hits += 1
        self._on_event("cache_hit", cache="disk", digest=digest, size=info.st_size)
        return path, (b"".join(chunks) if keep else None)

    def _remove_bad(self, path: Path, info: os.stat_result) -> None:
        """Unlink a corrupt entry unless a writer has replaced it meanwhile."""
        try:
            with self._locked() as locked:
                if not locked:
                    return
                now = os.lstat(path)
                if (now.st_dev, now.st_ino) != (info.st_dev, info.st_ino):
                    return
                os.unlink(path)
                if self._tally is not None:
                    self._tally = max(self._tally - now.st_size, 0)
        except OSError as e:
            self._error("remove", e, path=str(path))

    # -- writing

    def put(self, digest: str, source: bytes | os.PathLike[str] | str) -> bool:
        """
        Store C{source} (bytes, or the path of a file to copy) under
        C{digest} after checking that it hashes to C{digest}.

        @return: whether the object was written.  Disabled caches, malformed
            digests, hash mismatches, objects larger than the whole capacity
            and I/O errors all return C{False}.
        """
        path = self.path_for(digest)
        if path is None:
            return False
        if isinstance(source, (bytes, bytearray, memoryview)):
            data = bytes(source)
            if len(data) > self.capacity_bytes:
                return False
            if hashlib.sha256(data).hexdigest() != digest:
                self._error("hash mismatch on put", None, digest=digest)
                return False
            write: Callable[[int], int] = partial(_write_all, data=data)
        else:
            src = os.fspath(source)
            try:
                if os.stat(src).st_size > self.capacity_bytes:
                    return False
            except OSError as e:
                self._error("stat source", e, digest=digest)
                return False
            write = partial(_copy_verified, src=src, digest=digest)
        try:
            self._ensure_dirs(path.parent)
            with self._locked() as locked:
                if not locked:
                    return False
                return self._write_locked(path, digest, write)
        except OSError as e:
            self._error("write", e, digest=digest)
            return False

    def _write_locked(self, path: Path, digest: str, write: Callable[[int], int]) -> bool:
        tmp = path.parent / f"{TMP_PREFIX}{secrets.token_hex(8)}"
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        try:
            try:
                size = write(fd)
            finally:
                os.close(fd)
            if size > self.capacity_bytes:
                raise _Mismatch("larger than the capacity")
            try:
                old = os.lstat(path)
                old_size = old.st_size if stat.S_ISREG(old.st_mode) else 0
            except FileNotFoundError:
                old_size = 0
            os.replace(tmp, path)
        except _Mismatch as e:
            _unlink_quietly(tmp)
            self._error(str(e), None, digest=digest)
            return False
        except BaseException:
            _unlink_quietly(tmp)
            raise
        if self._tally is not None:
            self._tally += size - old_size
        with self._stats_lock:
            self.stored_bytes += size
        self._on_event("cache_stored", cache="disk", digest=digest, size=size)
        return True

    def _ensure_dirs(self, shard: Path) -> None:
        """Create C{shard} and any missing parents, each with mode 0700."""
        missing = []
        current = shard
        while not current.is_dir():
            missing.append(current)
            if current.parent == current:
                break
            current = current.parent
        for directory in reversed(missing):
            try:
                os.mkdir(directory, 0o700)
            except FileExistsError:
                pass

    # -- eviction

    def evict(self, force: bool = False) -> int:
        """
        Bring the cache within capacity: under the lock, remove stale
        C{.tmp-*} files, then delete valid entries oldest-mtime first until
        the total fits.  After the first scan, a call whose in-memory tally
        is already within capacity returns at once unless C{force} is set.

        @return: how many entries were evicted.
        """
        root = self.root
        if root is None:
            return 0
        if not force and self._tally is not None and self._tally <= self.capacity_bytes:
            return 0
        try:
            if not root.is_dir():
                self._tally = 0
                return 0
            with self._locked() as locked:
                if not locked:
                    return 0
                return self._evict_locked(root)
        except OSError as e:
            self._error("evict", e, path=str(root))
            return 0

    def _evict_locked(self, root: Path) -> int:
        entries: list[tuple[int, str, int, str]] = []
        with os.scandir(root) as shards:
            shard_names = [s.name for s in shards if _is_shard(s)]
        for shard in shard_names:
            shard_dir = root / shard
            try:
                with os.scandir(shard_dir) as it:
                    for entry in it:
                        name = entry.name
                        try:
                            if name.startswith(TMP_PREFIX):
                                os.unlink(entry.path)
                                continue
                            if not (is_digest(name) and name.startswith(shard)):
                                continue
                            info = entry.stat(follow_symlinks=False)
                        except OSError as e:
                            self._error("scan entry", e, path=entry.path)
                            continue
                        if stat.S_ISREG(info.st_mode):
                            entries.append((info.st_mtime_ns, name, info.st_size, entry.path))
            except OSError as e:
                self._error("scan shard", e, path=str(shard_dir))
        entries.sort()
        total = sum(entry[2] for entry in entries)
        evicted = 0
        for _mtime, name, size, entry_path in entries:
            if total <= self.capacity_bytes:
                break
            try:
                os.unlink(entry_path)
            except FileNotFoundError:
                pass
            except OSError as e:
                self._error("evict entry", e, path=entry_path)
                continue
            total -= size
            evicted += 1
            self._on_event("cache_evicted", cache="disk", digest=name, size=size)
        self._tally = total
        with self._stats_lock:
            self.evictions += evicted
        return evicted

    # -- helpers

    def _locked(self) -> _DirLock:
        root = self.root
        assert root is not None
        return _DirLock(self._lock, root, self)

    def _miss(self, digest: str) -> None:
        with self._stats_lock:
            self.misses += 1
        self._on_event("cache_miss", cache="disk", digest=digest)

    def _error(self, reason: str, error: OSError | None, **fields: object) -> None:
        with self._stats_lock:
            self.errors += 1
        if error is not None:
            fields["error"] = f"{type(error).__name__}: {error}"
        self._on_event("cache_error", cache="disk", reason=reason, **fields)


class _DirLock:
    """
    Context manager: the cache's thread lock, then an exclusive C{flock} on
    the C{v1} directory.  Yields C{False} (after reporting a C{cache_error})
    when the directory cannot be opened or locked.
    """

    def __init__(self, lock: threading.Lock, root: Path, cache: DiskFileCache) -> None:
        self._lock = lock
        self._root = root
        self._cache = cache
        self._fd: int | None = None

    def __enter__(self) -> bool:
        self._lock.acquire()
        try:
            fd = os.open(self._root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except BaseException:
                os.close(fd)
                raise
        except OSError as e:
            self._cache._error("lock", e, path=str(self._root))
            return False
        except BaseException:
            self._lock.release()
            raise
        self._fd = fd
        return True

    def __exit__(self, *exc_info: object) -> None:
        try:
            if self._fd is not None:
                os.close(self._fd)  # closing drops the flock
                self._fd = None
        finally:
            self._lock.release()


def _is_shard(entry: os.DirEntry[str]) -> bool:
    name = entry.name
    return len(name) == 2 and _HEX.issuperset(name) and entry.is_dir(follow_symlinks=False)


def _write_all(fd: int, data: bytes) -> int:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    return len(data)


def _copy_verified(fd: int, src: str, digest: str) -> int:
    """Copy C{src} into C{fd} while hashing; raise L{_Mismatch} if it differs."""
    hasher = hashlib.sha256()
    size = 0
    with open(src, "rb") as f:
        while chunk := f.read(_CHUNK):
            hasher.update(chunk)
            _write_all(fd, chunk)
            size += len(chunk)
    if hasher.hexdigest() != digest:
        raise _Mismatch("hash mismatch on put")
    return size


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


# ---------------------------------------------------------------------------
# Resolution


@attrs.frozen
class Resolution:
    """
    The outcome of L{BlobStore.resolve}.

    @ivar found: digest -> bytes for every resolved digest; the request owns
        these (bytes are immutable, so later eviction cannot affect them).
    @ivar missing: unresolved digests, in program order, without duplicates;
        non-empty means C{CACHE_MISS}.
    @ivar pin: memory-cache entries pinned for the request.  The caller
        releases it when the request finishes; it holds nothing when
        C{missing} is not empty.
    """

    found: dict[str, bytes | SharedBuffer]
    missing: list[str]
    pin: Pin


class BlobStore:
    """
    Reactor-side facade over both caches (protocol §5.1 steps 3, 4 and 6).

    Memory-cache calls run on the reactor thread; all disk-cache work of one
    request runs as a single job on C{threadpool}.
    """

    log = Logger()

    def __init__(
        self,
        memory: MemoryBlobCache,
        disk: DiskFileCache,
        threadpool: ThreadPool,
        reactor: IReactorFromThreads,
    ) -> None:
        self.memory = memory
        self.disk = disk
        self._threadpool = threadpool
        self._reactor = reactor

    async def resolve(
        self,
        program_blobs: Mapping[str, frozenset[str]],
        supplied: Mapping[str, bytes | SharedBuffer],
    ) -> Resolution:
        """
        Cache the supplied blobs and look up the rest.

        @param program_blobs: every referenced digest, in program order, with
            the upload kinds naming it.
        @param supplied: the request's blob parts, already hash-checked.
            Parts no upload references (rejected earlier with 400, see
            L{unreferenced}) are ignored.
        """
        # Step 3: offer the supplied blobs to the cache of each category.
        to_disk: list[tuple[str, bytes | SharedBuffer]] = []
        for digest, payload in supplied.items():
            kinds = program_blobs.get(digest)
            if not kinds:
                continue
            if kinds & MEMORY_KINDS:
                self.memory.put(digest, payload)
            if FILE_KIND in kinds:
                to_disk.append((digest, payload))
        disk_wanted = [
            digest
            for digest, kinds in program_blobs.items()
            if digest not in supplied and FILE_KIND in kinds
        ]
        from_disk: dict[str, bytes | SharedBuffer] = {}
        if self.disk.enabled and (to_disk or disk_wanted):
            try:
                from_disk = await deferToThreadPool(
                    self._reactor, self._threadpool, self._disk_job, to_disk, disk_wanted
                )
            except Exception:
                # DiskFileCache does not raise; this is belt and braces.
                self.log.failure("disk cache job failed; treating as misses")

        # Step 4: supplied bytes, then the disk cache, then the memory cache.
        found: dict[str, bytes | SharedBuffer] = {}
        missing: list[str] = []
        for digest, kinds in program_blobs.items():
            data: bytes | SharedBuffer | None = supplied.get(digest)
            if data is None:
                data = from_disk.get(digest)
            if data is None and kinds & MEMORY_KINDS:
                data = self.memory.get(digest)
            if data is None:
                missing.append(digest)
            else:
                found[digest] = data

        # Step 6 is the caller's CACHE_MISS; only admitted requests pin.
        if missing:
            return Resolution(found=found, missing=missing, pin=Pin.empty())
        memory_digests = [d for d, kinds in program_blobs.items() if kinds & MEMORY_KINDS]
        return Resolution(found=found, missing=missing, pin=self.memory.pin(memory_digests))

    def _disk_job(
        self, to_store: list[tuple[str, bytes | SharedBuffer]], wanted: list[str]
    ) -> dict[str, bytes | SharedBuffer]:
        """Thread pool: store a write batch, evict, then read C{wanted}."""
        if to_store:
            for digest, data in to_store:
                # A shared buffer is copied from its descriptor, not read whole.
                self.disk.put(digest, data.path() if isinstance(data, SharedBuffer) else data)
            self.disk.evict()
        found: dict[str, bytes | SharedBuffer] = {}
        for digest in wanted:
            cached = self.disk.get(digest)
            if cached is not None:
                found[digest] = cached
        return found
