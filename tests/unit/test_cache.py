"""
Tests for L{kcoral.server.cache}.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
import threading
from pathlib import Path
from typing import Any

from twisted.trial.unittest import SkipTest, SynchronousTestCase

from kcoral.ipc import shared
from kcoral.server.cache import (
    BlobStore,
    DiskFileCache,
    MemoryBlobCache,
    Pin,
    Resolution,
)
from kcoral.testing.fakes import EventRecorder, QueuedThreadReactor, SyncThreadPool
from kcoral.wire.program import is_digest

MiB = 1024 * 1024


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def blob(tag: str, size: int) -> tuple[str, bytes]:
    """A (digest, data) pair of C{size} bytes distinguished by C{tag}."""
    data = (tag.encode() * size)[:size]
    return sha(data), data


class TempDirMixin:
    def make_dir(self) -> Path:
        path = Path(tempfile.mkdtemp(prefix="kcoral-cache-test-"))
        self.addCleanup(_rmtree, path)
        return path


def _rmtree(path: Path) -> None:
    for root, dirs, files in os.walk(path, topdown=False):
        for name in files:
            os.unlink(os.path.join(root, name))
        for name in dirs:
            full = os.path.join(root, name)
            if os.path.islink(full):
                os.unlink(full)
            else:
                os.rmdir(full)
    os.rmdir(path)


class HelperTests(SynchronousTestCase):
    def test_is_digest(self) -> None:
        """Only 64 lowercase hex characters form a digest."""
        self.assertTrue(is_digest("a" * 64))
        self.assertFalse(is_digest("A" * 64))
        self.assertFalse(is_digest("a" * 63))
        self.assertFalse(is_digest("g" * 64))
        self.assertFalse(is_digest(None))


class MemoryBlobCacheTests(SynchronousTestCase):
    def test_miss_then_hit(self) -> None:
        """A stored blob is returned by get; counters follow."""
        cache = MemoryBlobCache(400)
        digest, data = blob("a", 10)
        self.assertIsNone(cache.get(digest))
        self.assertTrue(cache.put(digest, data))
        self.assertEqual(cache.get(digest), data)
        self.assertIn(digest, cache)
        self.assertEqual((cache.hits, cache.misses), (1, 1))
        self.assertEqual((cache.size_bytes, cache.count, cache.stored_bytes), (10, 1, 10))

    def test_lru_order(self) -> None:
        """The least recently used entry is evicted; get refreshes recency."""
        cache = MemoryBlobCache(400)
        a, b, c, d, e = (blob(t, 100) for t in "abcde")
        for digest, data in (a, b, c, d):
            cache.put(digest, data)
        self.assertEqual(cache.size_bytes, 400)
        cache.get(a[0])
        cache.put(*e)
        self.assertNotIn(b[0], cache)
        self.assertIn(a[0], cache)
        self.assertEqual(cache.evictions, 1)
        self.assertEqual(cache.size_bytes, 400)

    def test_reput_refreshes(self) -> None:
        """Putting an entry again makes it the most recently used."""
        cache = MemoryBlobCache(400)
        a, b, c, d, e = (blob(t, 100) for t in "abcde")
        for digest, data in (a, b, c, d):
            cache.put(digest, data)
        self.assertTrue(cache.put(*a))
        self.assertEqual(cache.stored_bytes, 400)
        cache.put(*e)
        self.assertIn(a[0], cache)
        self.assertNotIn(b[0], cache)

    def test_quarter_rule(self) -> None:
        """An object strictly larger than capacity // 4 is not stored."""
        cache = MemoryBlobCache(403)
        self.assertEqual(cache.max_object_bytes, 100)
        big = blob("x", 101)
        exact = blob("y", 100)
        self.assertFalse(cache.put(*big))
        self.assertNotIn(big[0], cache)
        self.assertTrue(cache.put(*exact))
        self.assertEqual(cache.size_bytes, 100)

    def test_bad_digest(self) -> None:
        """put rejects a key that is not a lowercase digest."""
        cache = MemoryBlobCache(400)
        self.assertRaises(ValueError, cache.put, "A" * 64, b"x")

    def test_pin_prevents_eviction(self) -> None:
        """
        Eviction skips pinned entries, even the oldest, and takes the least
        recently used unpinned one instead.
        """
        cache = MemoryBlobCache(400)
        a, b, c, d, e, f = (blob(t, 100) for t in "abcdef")
        for digest, data in (a, b, c, d):
            cache.put(digest, data)
        pin = cache.pin([a[0], b[0]])
        self.assertEqual(cache.pin_count(a[0]), 1)
        cache.put(*e)
        self.assertEqual([x[0] in cache for x in (a, b, c, d, e)], [1, 1, 0, 1, 1])
        # A get of a pinned entry is still a hit.
        self.assertEqual(cache.get(a[0]), a[1])
        cache.pin([d[0], e[0]])
        # Everything else is pinned: the newcomer itself is the one evicted.
        self.assertFalse(cache.put(*f))
        self.assertEqual((cache.size_bytes, cache.count), (400, 4))
        pin.release()
        self.assertTrue(cache.put(*f))
        self.assertNotIn(a[0], cache)

    def test_over_budget_then_recovers(self) -> None:
        """While pins hold more than the budget the cache stays over it."""
        cache = MemoryBlobCache(400)
        a, b, c, d = (blob(t, 100) for t in "abcd")
        for digest, data in (a, b, c, d):
            cache.put(digest, data)
        pin = cache.pin([a[0], b[0], c[0], d[0]])
        cache.capacity_bytes = 100
        cache.put(*blob("e", 20))
        self.assertEqual(cache.size_bytes, 400)
        self.assertEqual(cache.evictions, 1)
        pin.release()
        self.assertEqual(cache.size_bytes, 100)
        self.assertEqual(cache.count, 1)

    def test_release_makes_recent(self) -> None:
        """An entry whose last pin is released becomes the most recently used."""
        cache = MemoryBlobCache(400)
        a, b, c, d, e = (blob(t, 100) for t in "abcde")
        for digest, data in (a, b, c, d):
            cache.put(digest, data)
        cache.pin([a[0]]).release()
        cache.put(*e)
        self.assertIn(a[0], cache)
        self.assertNotIn(b[0], cache)

    def test_double_release_harmless(self) -> None:
        """A second release does nothing; other pins stay in force."""
        cache = MemoryBlobCache(400)
        a = blob("a", 100)
        cache.put(*a)
        first = cache.pin([a[0]])
        second = cache.pin([a[0], a[0]])
        self.assertEqual(cache.pin_count(a[0]), 2)
        first.release()
        first.release()
        self.assertTrue(first.released)
        self.assertEqual(cache.pin_count(a[0]), 1)
        with second:
            pass
        second.release()
        self.assertEqual(cache.pin_count(a[0]), 0)
        self.assertIn(a[0], cache)

    def test_pin_absent(self) -> None:
        """Absent digests are not pinned; pinning nothing gives an empty pin."""
        cache = MemoryBlobCache(400)
        a = blob("a", 10)
        cache.put(*a)
        pin = cache.pin([a[0], "f" * 64])
        self.assertEqual(pin.digests, (a[0],))
        empty = cache.pin(["f" * 64])
        self.assertEqual(empty.digests, ())
        self.assertTrue(empty.released)
        empty.release()
        pin.release()

    def test_events(self) -> None:
        """The callback sees stored, hit, miss and evicted events."""
        events = EventRecorder()
        cache = MemoryBlobCache(4, on_event=events)
        a, b, c, d, e = (blob(t, 1) for t in "abcde")
        cache.put(*a)
        cache.get(a[0])
        cache.get(b[0])
        for digest, data in (b, c, d, e):
            cache.put(digest, data)
        self.assertEqual(
            events.names(),
            ["cache_stored", "cache_hit", "cache_miss"] + ["cache_stored"] * 4 + ["cache_evicted"],
        )
        self.assertEqual(events.events[-1][1], {"cache": "memory", "digest": a[0], "size": 1})


class SharedEntriesTests(SynchronousTestCase):
    """The memory cache keeps sealed shared buffers as they are, a bounded number."""

    def setUp(self) -> None:
        if not shared.available():
            raise SkipTest("no sealed memfds here")

    def test_kept_as_shared_buffers_up_to_the_limit(self) -> None:
        cache = MemoryBlobCache(1 << 20, max_shared_entries=2)
        blobs = [os.urandom(1000) for _ in range(3)]
        digests = [hashlib.sha256(b).hexdigest() for b in blobs]
        for digest, blob in zip(digests, blobs, strict=True):
            self.assertTrue(cache.put(digest, shared.share(blob)))
        kinds = [type(cache.get(d)).__name__ for d in digests]
        # The third is kept as bytes: the cache holds two descriptors at most.
        self.assertEqual(kinds, ["SharedBuffer", "SharedBuffer", "bytes"])
        self.assertEqual(cache.get(digests[2]), blobs[2])
        self.assertEqual(cache.size_bytes, 3000)
        self.assertEqual(cache.shared_entries, 2)

    def test_eviction_frees_the_descriptor(self) -> None:
        cache = MemoryBlobCache(4000, max_shared_entries=10)
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(6):
            blob = os.urandom(1000)
            cache.put(hashlib.sha256(blob).hexdigest(), shared.share(blob))
        self.assertEqual(len(cache), 4)
        self.assertEqual(cache.shared_entries, 4)
        self.assertEqual(len(os.listdir("/proc/self/fd")), before + 4)


class DiskFileCacheTests(TempDirMixin, SynchronousTestCase):
    def make_cache(self, capacity_mbytes: int = 1, **kwargs: Any) -> DiskFileCache:
        directory = kwargs.pop("directory", None) or self.make_dir() / "files"
        return DiskFileCache(directory, capacity_mbytes, **kwargs)

    def test_layout_and_permissions(self) -> None:
        """Objects live at v1/<2 hex>/<digest>; dirs 0700, files 0600."""
        cache = self.make_cache()
        digest, data = blob("a", 1000)
        self.assertTrue(cache.put(digest, data))
        assert cache.directory is not None
        path = cache.directory / "v1" / digest[:2] / digest
        self.assertEqual(path.read_bytes(), data)
        self.assertEqual(stat.S_IMODE(path.stat().st_mode), 0o600)
        for directory in (cache.directory, path.parent.parent, path.parent):
            self.assertEqual(stat.S_IMODE(directory.stat().st_mode), 0o700)
        self.assertEqual(os.listdir(path.parent), [digest])
        self.assertEqual(cache.get(digest), data)
        self.assertEqual(cache.get_path(digest), path)
        self.assertIn(digest, cache)

    def test_put_from_path(self) -> None:
        """put copies from a file path after verifying its hash."""
        cache = self.make_cache()
        digest, data = blob("p", 5000)
        source = self.make_dir() / "src"
        source.write_bytes(data)
        self.assertTrue(cache.put(digest, source))
        self.assertEqual(cache.get(digest), data)
        self.assertFalse(cache.put(sha(b"other"), source))
        self.assertIsNone(cache.get(sha(b"other")))

    def test_put_mismatch(self) -> None:
        """A hash mismatch is not stored and leaves no temporary file."""
        cache = self.make_cache()
        digest = sha(b"right")
        self.assertFalse(cache.put(digest, b"wrong"))
        self.assertIsNone(cache.get(digest))
        source = self.make_dir() / "src"
        source.write_bytes(b"wrong")
        self.assertFalse(cache.put(digest, source))
        assert cache.root is not None
        leftovers = [name for _, _, files in os.walk(cache.root) for name in files]
        self.assertEqual(leftovers, [])

    def test_survives_restart(self) -> None:
        """A new instance on the same directory finds earlier objects."""
        directory = self.make_dir() / "files"
        digest, data = blob("r", 100)
        self.assertTrue(DiskFileCache(directory, 1).put(digest, data))
        again = DiskFileCache(directory, 1)
        self.assertEqual(again.evict(), 0)
        self.assertEqual(again.tally_bytes, 100)
        self.assertEqual(again.get(digest), data)

    def test_corrupted_is_miss_and_removed(self) -> None:
        """A file whose content no longer matches is a miss and is deleted."""
        events = EventRecorder()
        cache = self.make_cache(on_event=events)
        digest, data = blob("c", 100)
        cache.put(digest, data)
        path = cache.path_for(digest)
        assert path is not None
        path.write_bytes(b"garbage")
        self.assertIsNone(cache.get(digest))
        self.assertFalse(path.exists())
        self.assertIn("cache_error", events.names())
        self.assertEqual(cache.misses, 1)

    def test_symlink_is_miss(self) -> None:
        """A symlink is never followed, even to correct content."""
        cache = self.make_cache()
        digest, data = blob("s", 100)
        target = self.make_dir() / "target"
        target.write_bytes(data)
        path = cache.path_for(digest)
        assert path is not None
        path.parent.mkdir(parents=True)
        path.symlink_to(target)
        self.assertIsNone(cache.get(digest))
        self.assertIsNone(cache.get_path(digest))
        self.assertNotIn(digest, cache)
        # A later write replaces the link itself.
        self.assertTrue(cache.put(digest, data))
        self.assertFalse(path.is_symlink())
        self.assertEqual(cache.get(digest), data)

    def test_fifo_is_miss(self) -> None:
        """A non-regular file (a FIFO) is a miss, without blocking."""
        cache = self.make_cache()
        digest = sha(b"fifo")
        path = cache.path_for(digest)
        assert path is not None
        path.parent.mkdir(parents=True)
        os.mkfifo(path)
        self.assertIsNone(cache.get(digest))

    def test_get_bumps_mtime(self) -> None:
        """A read sets the mtime to now."""
        cache = self.make_cache()
        digest, data = blob("m", 100)
        cache.put(digest, data)
        path = cache.path_for(digest)
        assert path is not None
        os.utime(path, (1000, 1000))
        cache.get(digest)
        self.assertGreater(path.stat().st_mtime, 1000)

    def test_evict_removes_stale_tmp(self) -> None:
        """evict deletes leftover .tmp-* files and ignores foreign names."""
        cache = self.make_cache()
        digest, data = blob("t", 100)
        cache.put(digest, data)
        path = cache.path_for(digest)
        assert path is not None
        stale = path.parent / ".tmp-deadbeef"
        stale.write_bytes(b"half written")
        foreign = path.parent / "README"
        foreign.write_bytes(b"x")
        cache.evict(force=True)
        self.assertFalse(stale.exists())
        self.assertTrue(foreign.exists())
        self.assertTrue(path.exists())

    def test_capacity_oldest_mtime_first(self) -> None:
        """Eviction deletes oldest-mtime entries until the total fits."""
        directory = self.make_dir() / "files"
        cache = DiskFileCache(directory, 1)
        objects = [blob(t, 300 * 1024) for t in "abc"]
        for when, (digest, data) in zip((3000, 1000, 2000), objects, strict=True):
            cache.put(digest, data)
            path = cache.path_for(digest)
            assert path is not None
            os.utime(path, (when, when))
        # A fresh instance scans: 900 KiB fit in 1 MiB.
        cache = DiskFileCache(directory, 1)
        self.assertEqual(cache.evict(), 0)
        digest, data = blob("d", 300 * 1024)
        cache.put(digest, data)
        self.assertEqual(cache.evict(), 1)
        self.assertNotIn(objects[1][0], cache)
        for other in (objects[0], objects[2], (digest, data)):
            self.assertIn(other[0], cache)
        self.assertLessEqual(cache.tally_bytes or 0, MiB)

        # A read refreshes: "c" (mtime 2000) is read, so "a" (3000) goes next.
        cache.get(objects[2][0])
        cache.put(*blob("e", 300 * 1024))
        self.assertEqual(cache.evict(), 1)
        self.assertNotIn(objects[0][0], cache)
        self.assertIn(objects[2][0], cache)

    def test_tally_skips_scan(self) -> None:
        """Within capacity, evict skips the scan unless forced."""
        cache = self.make_cache()
        cache.evict()
        digest, data = blob("k", 100)
        cache.put(digest, data)
        assert cache.root is not None
        stale = cache.root / digest[:2] / ".tmp-00"
        stale.write_bytes(b"")
        cache.evict()
        self.assertTrue(stale.exists())
        cache.evict(force=True)
        self.assertFalse(stale.exists())
        self.assertEqual(cache.tally_bytes, 100)

    def test_larger_than_capacity_skipped(self) -> None:
        """An object larger than the whole capacity is not written."""
        cache = self.make_cache(1)
        digest, data = blob("b", MiB + 1)
        self.assertFalse(cache.put(digest, data))
        source = self.make_dir() / "src"
        source.write_bytes(data)
        self.assertFalse(cache.put(digest, source))
        self.assertNotIn(digest, cache)
        fits = blob("f", MiB)
        self.assertTrue(cache.put(*fits))

    def test_unwritable_never_raises(self) -> None:
        """
        A cache directory below a regular file makes every mkdir fail; all
        methods degrade to misses and skipped writes and report errors.
        """
        blocker = self.make_dir() / "plain-file"
        blocker.write_bytes(b"not a directory")
        events = EventRecorder()
        cache = DiskFileCache(blocker / "files", 1, on_event=events)
        digest, data = blob("u", 100)
        self.assertTrue(cache.enabled)
        self.assertEqual(cache.evict(), 0)
        self.assertFalse(cache.put(digest, data))
        self.assertIsNone(cache.get(digest))
        self.assertIsNone(cache.get_path(digest))
        self.assertNotIn(digest, cache)
        self.assertIn("cache_error", events.names())
        self.assertGreater(cache.errors, 0)

    def test_disabled(self) -> None:
        """No directory, an empty one, or zero capacity disables the cache."""
        base = self.make_dir()
        digest, data = blob("z", 10)
        for cache in (
            DiskFileCache(None, 100),
            DiskFileCache("", 100),
            DiskFileCache(base / "files", 0),
        ):
            self.assertFalse(cache.enabled)
            self.assertIsNone(cache.root)
            self.assertFalse(cache.put(digest, data))
            self.assertIsNone(cache.get(digest))
            self.assertIsNone(cache.get_path(digest))
            self.assertEqual(cache.evict(), 0)
            self.assertNotIn(digest, cache)
        self.assertEqual(os.listdir(base), [])

    def test_bad_digest(self) -> None:
        """Malformed digests are misses and skipped writes."""
        cache = self.make_cache()
        self.assertFalse(cache.put("../../etc", b"x"))
        self.assertIsNone(cache.get("A" * 64))
        self.assertIsNone(cache.path_for("zz"))

    def test_threads(self) -> None:
        """Concurrent writers and readers leave only complete, valid files."""
        cache = self.make_cache(1)
        objects = [blob(f"{i:03d}", 64 * 1024) for i in range(24)]
        errors: list[BaseException] = []

        def work(chunk: list[tuple[str, bytes]]) -> None:
            try:
                for digest, data in chunk:
                    cache.put(digest, data)
                    cache.evict()
                    got = cache.get(digest)
                    if got is not None and got != data:
                        raise AssertionError("bad read")
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=work, args=(objects[i::4],)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(errors, [])
        cache.evict(force=True)
        assert cache.root is not None
        total = 0
        for root, _, files in os.walk(cache.root):
            for name in files:
                self.assertFalse(name.startswith(".tmp-"))
                total += os.path.getsize(os.path.join(root, name))
        self.assertLessEqual(total, MiB)
        self.assertEqual(cache.errors, 0)


class BlobStoreTests(TempDirMixin, SynchronousTestCase):
    def setUp(self) -> None:
        self.reactor = QueuedThreadReactor()
        self.pool = SyncThreadPool()
        self.memory = MemoryBlobCache(4 * MiB)
        self.disk = DiskFileCache(self.make_dir() / "files", 4)

    def store(self, disk: DiskFileCache | None = None) -> BlobStore:
        return BlobStore(self.memory, disk or self.disk, self.pool, self.reactor)

    def resolve(self, store: BlobStore, program, supplied) -> Resolution:
        from twisted.internet.defer import Deferred

        d = Deferred.fromCoroutine(store.resolve(program, supplied))
        self.reactor.advance(0)
        return self.successResultOf(d)

    def test_supplied_offered_by_kind(self) -> None:
        """Supplied blobs go to memory for tensor/bytes/library, disk for file."""
        b, f, both = blob("b", 10), blob("f", 10), blob("x", 10)
        program = {
            b[0]: frozenset({"bytes"}),
            f[0]: frozenset({"file"}),
            both[0]: frozenset({"library", "file"}),
        }
        result = self.resolve(self.store(), program, dict([b, f, both]))
        self.assertEqual(result.missing, [])
        self.assertEqual(result.found, dict([b, f, both]))
        self.assertIn(b[0], self.memory)
        self.assertNotIn(f[0], self.memory)
        self.assertIn(both[0], self.memory)
        self.assertNotIn(b[0], self.disk)
        self.assertIn(f[0], self.disk)
        self.assertIn(both[0], self.disk)
        result.pin.release()

    def test_result_arrives_on_reactor(self) -> None:
        """Disk work returns through callFromThread, not synchronously."""
        from twisted.internet.defer import Deferred

        f = blob("f", 10)
        d = Deferred.fromCoroutine(self.store().resolve({f[0]: frozenset({"file"})}, dict([f])))
        self.assertNoResult(d)
        self.reactor.advance(0)
        self.assertEqual(self.successResultOf(d).found, dict([f]))
        self.assertEqual(self.pool.jobs, 1)

    def test_memory_only_needs_no_thread(self) -> None:
        """A program without file uploads never touches the thread pool."""
        from twisted.internet.defer import Deferred

        b = blob("b", 10)
        self.memory.put(*b)
        d = Deferred.fromCoroutine(self.store().resolve({b[0]: frozenset({"tensor"})}, {}))
        self.assertEqual(self.successResultOf(d).found, dict([b]))
        self.assertEqual(self.pool.jobs, 0)

    def test_resolution_order(self) -> None:
        """Supplied bytes first, then the disk cache, then the memory cache."""
        x = blob("x", 10)
        self.memory.put(*x)
        self.disk.put(*x)
        program = {x[0]: frozenset({"bytes", "file"})}
        result = self.resolve(self.store(), program, {})
        self.assertEqual(result.found, dict([x]))
        self.assertEqual((self.disk.hits, self.memory.hits), (1, 0))
        result.pin.release()

        result = self.resolve(self.store(), program, dict([x]))
        self.assertEqual((self.disk.hits, self.memory.hits), (1, 0))
        result.pin.release()

        # Not on disk: falls back to memory because a bytes upload names it.
        path = self.disk.path_for(x[0])
        assert path is not None
        path.unlink()
        result = self.resolve(self.store(), program, {})
        self.assertEqual(result.found, dict([x]))
        self.assertEqual(self.memory.hits, 1)
        result.pin.release()

    def test_cross_category(self) -> None:
        """
        Bytes cached only in memory do not satisfy a later file upload when
        the disk cache is disabled or lacks them.
        """
        x = blob("x", 10)
        first = self.resolve(self.store(), {x[0]: frozenset({"bytes"})}, dict([x]))
        first.pin.release()
        self.assertIn(x[0], self.memory)
        for disk in (self.disk, DiskFileCache(None, 0)):
            result = self.resolve(self.store(disk), {x[0]: frozenset({"file"})}, {})
            self.assertEqual(result.missing, [x[0]])
            self.assertEqual(result.found, {})

    def test_missing_order(self) -> None:
        """Missing digests are listed in program order, once each."""
        a, b, c, d = (blob(t, 10) for t in "abcd")
        self.memory.put(*b)
        program = {
            c[0]: frozenset({"file"}),
            b[0]: frozenset({"tensor"}),
            a[0]: frozenset({"bytes", "file"}),
            d[0]: frozenset({"library"}),
        }
        result = self.resolve(self.store(), program, {})
        self.assertEqual(result.missing, [c[0], a[0], d[0]])
        self.assertEqual(result.found, dict([b]))
        self.assertTrue(result.pin.released)
        self.assertEqual(self.memory.pin_count(b[0]), 0)

        # The retry supplies exactly the missing blobs and succeeds.
        result = self.resolve(self.store(), program, dict([c, a, d]))
        self.assertEqual(result.missing, [])
        self.assertEqual(set(result.found), set(program))

    def test_pins_memory_entries(self) -> None:
        """An admitted request pins its memory entries until released."""
        a, f = blob("a", 10), blob("f", 10)
        program = {a[0]: frozenset({"tensor"}), f[0]: frozenset({"file"})}
        result = self.resolve(self.store(), program, dict([a, f]))
        self.assertIsInstance(result.pin, Pin)
        self.assertEqual(result.pin.digests, (a[0],))
        self.assertEqual(self.memory.pin_count(a[0]), 1)
        result.pin.release()
        self.assertEqual(self.memory.pin_count(a[0]), 0)

    def test_disk_failure_does_not_reject(self) -> None:
        """A broken disk cache never stops a request that supplied its bytes."""
        blocker = self.make_dir() / "plain-file"
        blocker.write_bytes(b"")
        broken = DiskFileCache(blocker / "files", 4)
        f = blob("f", 10)
        result = self.resolve(self.store(broken), {f[0]: frozenset({"file"})}, dict([f]))
        self.assertEqual(result.found, dict([f]))
        self.assertEqual(result.missing, [])
        result = self.resolve(self.store(broken), {f[0]: frozenset({"file"})}, {})
        self.assertEqual(result.missing, [f[0]])

    def test_unreferenced_ignored(self) -> None:
        """Supplied parts no upload names are not cached."""
        a, stray = blob("a", 10), blob("s", 10)
        result = self.resolve(self.store(), {a[0]: frozenset({"bytes"})}, dict([a, stray]))
        self.assertEqual(result.found, dict([a]))
        self.assertNotIn(stray[0], self.memory)
        self.assertNotIn(stray[0], self.disk)
