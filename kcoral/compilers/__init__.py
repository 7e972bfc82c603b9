# -*- test-case-name: tests.unit.test_compilers -*-
"""
CUDA C compiler backends: discovery and the entry point the worker uses.

 - L{backends}: every L{ICompilerBackend} plugin in C{kcoral.plugins}
   (C{twisted.plugin.getPlugins}), checked with C{verifyObject}.
 - L{get_backend}: one by name, or L{MissingBackend}.
 - L{compile_binary}: source -> module image bytes, through the compile cache.
 - L{compile_stats}: compile and cache counters.

Imports stay light: Twisted's plugin machinery is imported only when
backends are first looked up.

Layer rule: beside C{kcoral.wire} and C{kcoral.config} at the bottom; no
reactor, Klein or treq, and nothing from C{kcoral.server}, C{kcoral.worker}
or C{kcoral.client} (tests/unit/test_layers.py checks every module's
imports).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from kcoral.compilers.cache import CompileCache, cache_key
from kcoral.compilers.interfaces import (
    KIND_BINARY,
    KIND_LOADABLE,
    DuplicateBackend,
    ICompilerBackend,
    MissingBackend,
)

__all__ = [
    "KIND_BINARY",
    "KIND_LOADABLE",
    "DEFAULT_TIMEOUT",
    "CACHE_DIR_ENV",
    "DuplicateBackend",
    "ICompilerBackend",
    "MissingBackend",
    "backends",
    "cacheable",
    "compile_binary",
    "compile_stats",
    "configure_cache",
    "get_backend",
    "warm_up",
]

#: Seconds a compile may take unless the caller says otherwise.
DEFAULT_TIMEOUT = 120.0

#: Environment variable naming the default compile-cache directory.
CACHE_DIR_ENV = "KCORAL_COMPILE_CACHE_DIR"

#: Default capacity of a compile cache (1 GiB).
DEFAULT_CACHE_CAPACITY = 1 << 30

_lock = threading.Lock()
_known: dict[str, Any] | None = None
_caches: dict[str, CompileCache] = {}
_default_cache: tuple[str, int] | None = None
_stats = {"compiles": 0, "compile_seconds": 0.0, "failures": 0, "uncached": 0}


def backends() -> dict[str, Any]:
    """
    Discover compiler backends afresh.

    Every object in the C{kcoral.plugins} package path that provides
    L{ICompilerBackend} is checked with C{verifyObject}; invalid ones are
    skipped with a logged warning.

    @return: C{{name: backend}}.
    @raise DuplicateBackend: two valid backends share a name.
    """
    from twisted.logger import Logger
    from twisted.plugin import getPlugins
    from zope.interface.exceptions import Invalid
    from zope.interface.verify import verifyObject

    import kcoral.plugins

    log = Logger(namespace=__name__)
    found: dict[str, Any] = {}
    for plugin in getPlugins(ICompilerBackend, kcoral.plugins):
        try:
            verifyObject(ICompilerBackend, plugin)
            name = plugin.name
            if not isinstance(name, str) or not name:
                raise Invalid(f"name must be a non-empty str, got {name!r}")
        except Invalid as e:
            log.warn(
                "skipping invalid compiler backend {plugin!r}: {error}",
                plugin=plugin,
                error=str(e),
            )
            continue
        if name in found:
            raise DuplicateBackend(
                f"two compiler backends are named {name!r}: {found[name]!r} and {plugin!r}"
            )
        found[name] = plugin
    global _known
    with _lock:
        _known = dict(found)
    return found


def get_backend(name: str) -> Any:
    """
    The backend called C{name}; rescans the plugins once if it is not known yet.

    @raise MissingBackend: no backend has that name.
    @raise DuplicateBackend: see L{backends}.
    """
    with _lock:
        known = _known
    if known is None or name not in known:
        known = backends()
    try:
        return known[name]
    except KeyError:
        raise MissingBackend(
            f"no compiler backend named {name!r} (known: {', '.join(sorted(known)) or 'none'})"
        ) from None


def warm_up() -> None:
    """
    BLOCKING: discover the backends and probe the nvcc toolchain once, so a
    process forked after this (a worker from its template) does neither.
    Never raises: what fails here is found again, and reported, at the
    first compile.
    """
    try:
        known = backends()
    except DuplicateBackend:
        return
    nvcc = known.get("nvcc")
    if nvcc is not None:
        nvcc.versions()


def configure_cache(directory: str | None, capacity_bytes: int = DEFAULT_CACHE_CAPACITY) -> None:
    """
    Set the cache L{compile_binary} uses when it is given no C{cache_dir}.
    C{None} turns the default cache off. Without a call, C{$KCORAL_COMPILE_CACHE_DIR}
    is used when set.
    """
    global _default_cache
    with _lock:
        _default_cache = None if directory is None else (directory, int(capacity_bytes))


def _cache_for(cache_dir: str | None) -> CompileCache | None:
    with _lock:
        if cache_dir is None:
            if _default_cache is not None:
                cache_dir, capacity = _default_cache
            elif os.environ.get(CACHE_DIR_ENV):
                cache_dir, capacity = os.environ[CACHE_DIR_ENV], DEFAULT_CACHE_CAPACITY
            else:
                return None
        else:
            capacity = DEFAULT_CACHE_CAPACITY
        key = os.path.abspath(cache_dir)
        cache = _caches.get(key)
        if cache is None:
            try:
                cache = _caches[key] = CompileCache(key, capacity)
            except OSError:
                return None
        return cache


#: Set (to C{1}) in a worker's environment when the server compiles its
#: cacheable sources (L{configure_remote}, C{kcoral.server.workers.compiles}).
COMPILE_IN_PARENT_ENV = "KCORAL_COMPILE_IN_PARENT"

#: C{remote(source, arch, flags, backend, timeout) -> (key, seconds, cached)}.
Remote = Callable[[str, str, tuple[str, ...], str, float], tuple[str, float, bool]]

#: Compiles into the shared cache done elsewhere (a sandboxed worker asks
#: its parent, L{configure_remote}); C{None} compiles here.
_remote: Remote | None = None


def configure_remote(remote: Remote | None) -> None:
    """
    Compile cacheable sources through C{remote(source, arch, flags, backend,
    timeout)}, which returns the key the image is stored under in the
    (read-only here) cache, the compile seconds and whether the entry was
    there already, or raises L{kcoral.errors.ExecutionError}.  The remote
    computes the key and looks the cache up itself, so this process neither
    probes the toolchain nor hashes the source for such a compile.  C{None}
    compiles in this process.
    """
    global _remote
    _remote = remote


def cacheable(flags: tuple[str, ...]) -> bool:
    """
    Whether a compile with C{flags} goes through the compile cache: not
    with C{-I} (headers from include directories are not part of the key).
    """
    return not any(f.startswith(("-I", "--include-path")) for f in flags)


def compile_binary(
    source: str,
    arch: str,
    flags: tuple[str, ...] = (),
    timeout: float = DEFAULT_TIMEOUT,
    *,
    backend: str | Any = "nvcc",
    cache_dir: str | None = None,
) -> bytes:
    """
    Compile CUDA C C{source} into a module image for C{arch}.

    With the default C{nvcc} backend the result is a cubin for exactly
    C{arch} (e.g. C{sm_90a}); see L{kcoral.compilers.nvcc}.

    @param flags: extra compiler flags (validated by the backend).
    @param timeout: seconds the compiler may run.
    @param backend: a backend name, or an L{ICompilerBackend} provider.
    @param cache_dir: compile-cache directory; default: L{configure_cache}
        or C{$KCORAL_COMPILE_CACHE_DIR}, else no cache. Compiles with C{-I}
        flags are never cached (included headers are not in the key).

    @raise kcoral.errors.ExecutionError: C{parse}, C{compile} or
        C{unavailable} (no such backend, or its toolchain is missing).
    """
    from kcoral.errors import ExecutionError

    if isinstance(backend, str):
        try:
            impl = get_backend(backend)
        except MissingBackend as e:
            raise ExecutionError("unavailable", str(e)) from None
    else:
        impl = backend
    if not isinstance(arch, str):
        raise ExecutionError("parse", f"arch must be a string, got {type(arch).__name__}")
    if isinstance(flags, (str, bytes)) or not all(isinstance(f, str) for f in flags):
        raise ExecutionError("parse", "compiler flags must be a list of strings")
    flags = tuple(flags)
    ok, reason = impl.available()
    if not ok:
        raise ExecutionError(
            "unavailable", f"compiler backend {impl.name!r} is unavailable: {reason}"
        )

    cache = _cache_for(cache_dir) if cacheable(flags) else None
    if cache is not None and _remote is not None:
        try:
            return _compile_remotely(cache, source, arch, flags, impl.name, float(timeout))
        except ExecutionError as e:
            if e.kind != "unavailable":
                with _lock:
                    _stats["failures"] += 1
                raise
        # The parent cannot compile with this backend (its sandbox lacks
        # what it needs): compile here, for this process only.
        cache = None
    key = None
    if cache is not None:
        key = cache_key(source, arch, flags, impl.name, impl.versions())
        image = cache.get(key)
        if image is not None:
            return image
    else:
        with _lock:
            _stats["uncached"] += 1

    started = time.monotonic()
    try:
        image = bytes(impl.compile(source, arch, flags, float(timeout)))
    except BaseException:
        with _lock:
            _stats["failures"] += 1
        raise
    elapsed = time.monotonic() - started
    with _lock:
        _stats["compiles"] += 1
        _stats["compile_seconds"] += elapsed
    if cache is not None and key is not None:
        cache.put(key, image, elapsed)
    return image


def _compile_remotely(
    cache: CompileCache,
    source: str,
    arch: str,
    flags: tuple[str, ...],
    backend: str,
    timeout: float,
) -> bytes:
    """
    Have the parent look the entry up or compile it into the shared cache,
    then read the entry back (its sha256 checked).
    """
    from kcoral.errors import ExecutionError

    assert _remote is not None
    key, seconds, cached = _remote(source, arch, flags, backend, timeout)
    entry = cache.read(key)
    if entry is None:
        raise ExecutionError("engine", "the compiled image is missing from the compile cache")
    if cached:
        cache.count_hit(entry[1])
        return entry[0]
    cache.count_miss()
    with _lock:
        _stats["compiles"] += 1
        _stats["compile_seconds"] += seconds
    return entry[0]


def compile_stats() -> dict[str, Any]:
    """
    Compile counters of this process.

    @return: C{{compiles, compile_seconds, failures, uncached, cache_hits,
        cache_misses, saved_seconds, caches: {dir: {hits, misses,
        saved_seconds, size_bytes}}}}; C{saved_seconds} sums the original
        compile times of the images served from a cache.
    """
    with _lock:
        out: dict[str, Any] = dict(_stats)
        caches = dict(_caches)
    out["compile_seconds"] = round(out["compile_seconds"], 6)
    per = {}
    hits = misses = 0
    saved = 0.0
    for directory, cache in sorted(caches.items()):
        s = cache.stats()
        hits += int(s["hits"])  # type: ignore[call-overload]
        misses += int(s["misses"])  # type: ignore[call-overload]
        saved += float(s["saved_seconds"])  # type: ignore[arg-type]
        per[directory] = dict(s, size_bytes=cache.size_bytes())
    out.update(cache_hits=hits, cache_misses=misses, saved_seconds=round(saved, 6), caches=per)
    return out


def _reset_for_tests() -> None:
    """Forget discovered backends, caches and counters."""
    global _known, _default_cache, _remote
    with _lock:
        _known = None
        _remote = None
        _caches.clear()
        _default_cache = None
        for k in _stats:
            _stats[k] = 0
