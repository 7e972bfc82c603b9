# -*- test-case-name: tests.unit.test_compilers,tests.integration.test_nvcc -*-
"""
L{NvccBackend}: CUDA C source -> cubin with the NVIDIA toolchain, no GPU needed.

Also the argument policy shared by every backend that ends up running nvcc:
L{validate_arch}, L{validate_options} and L{shorten}.

Output format
=============
C{compile(source, "sm_90a", (), t)} runs C{nvcc -cubin -arch=sm_90a} and
returns a cubin (an ELF image) with SASS for exactly that architecture and no
PTX: it loads only on a device of that compute capability (C{sm_90a}: H100/H200).
That is what C{builtin.compile_cuda_binary} returns: the GPU server's
C{/health} C{target.arch} names the arch to ask for.

Two ways to get a fat binary instead (a C{fatbin}, also accepted by
C{cuModuleLoadData}/C{module_from_buffer}):
 - put C{-fatbin} (or C{--fatbin}) in C{options}: SASS for C{sm_NN} plus PTX for
   C{compute_NN}, so newer devices can JIT the PTX;
 - ask for a virtual arch C{compute_NN}: PTX only (a cubin cannot hold it), JIT
   compiled by the driver at load time.

Runs in the worker process: blocking C{subprocess} is deliberate here, never
call this on the reactor thread.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading

import attrs
from twisted.plugin import IPlugin
from zope.interface import implementer

from kcoral.compilers.interfaces import KIND_BINARY, ICommandLineBackend, ICompilerBackend
from kcoral.errors import ExecutionError

__all__ = [
    "ARCH_RE",
    "NvccBackend",
    "find_nvcc",
    "parse_nvcc_version",
    "probe_versions",
    "shorten",
    "validate_arch",
    "validate_options",
]

#: A real (C{sm_}) or virtual (C{compute_}) architecture, with the optional
#: arch-specific (C{a}) or family-specific (C{f}) suffix: C{sm_90a}, C{sm_100f}.
ARCH_RE = re.compile(r"(sm|compute)_([0-9]{2,3})([af]?)", re.ASCII)

#: Diagnostics longer than this are shortened keeping both ends (protocol 9.3).
DIAGNOSTICS_LIMIT = 600

#: Name of the source file inside the private directory; diagnostics read
#: C{kernel.cu(LINE): error: ...}.
SOURCE_NAME = "kernel.cu"

#: Name of the image nvcc writes beside it (a cubin or a fatbin).
OUTPUT_NAME = "module.bin"

#: Characters a flag's value may hold (a C{-D} macro value, a C{-I}
#: directory).  nvcc runs its sub-commands (the host preprocessor, cicc,
#: ptxas) through C{/bin/sh} with each value in double quotes, so C{$},
#: backquotes, backslashes and quotes in a value would run commands; this
#: allow-list has no shell metacharacter at all (issue 32, item 1).
SAFE_VALUE_CHARS = "A-Za-z0-9_.,+=@%:/-"

_SAFE_VALUE = re.compile(f"[{SAFE_VALUE_CHARS}]*", re.ASCII)
_MACRO = r"[A-Za-z_][A-Za-z0-9_]*"
_MACRO_DEFINITION = re.compile(rf"{_MACRO}(?:=[{SAFE_VALUE_CHARS}]*)?", re.ASCII)

# Flags taken as one argument (the whole token must match).
_SINGLE = re.compile(
    rf"""(?:
        -O[0-3]
      | -lineinfo | --generate-line-info
      | --?use_fast_math
      | -g | -G | --device-debug | --debug
      | --?expt-relaxed-constexpr | --?expt-extended-lambda | --?extended-lambda
      | -w | --disable-warnings
      | -W(?:no-)?[A-Za-z][A-Za-z0-9_-]*
      | -Werror=[A-Za-z0-9_,-]+
      | -res-usage | --resource-usage
      | --?std=c\+\+[0-9][0-9]
      | -D{_MACRO_DEFINITION.pattern}
      | --define-macro={_MACRO_DEFINITION.pattern}
      | -U{_MACRO}
      | --undefine-macro={_MACRO}
      | --?maxrregcount=[0-9]{{1,3}}
      | --?(?:ftz|prec-div|prec-sqrt|fmad)=(?:true|false)
    )""",
    re.VERBOSE | re.ASCII,
)

# Flags whose value is the next argument; the whole value must match.
_PAIRED = {
    "-std": re.compile(r"c\+\+[0-9][0-9]", re.ASCII),
    "--std": re.compile(r"c\+\+[0-9][0-9]", re.ASCII),
    "-D": _MACRO_DEFINITION,
    "--define-macro": _MACRO_DEFINITION,
    "-U": re.compile(_MACRO, re.ASCII),
    "-maxrregcount": re.compile(r"[0-9]{1,3}", re.ASCII),
    "--maxrregcount": re.compile(r"[0-9]{1,3}", re.ASCII),
}

# Options nvcc may forward to ptxas (each element of a comma list).
_PTXAS = re.compile(
    r"""(?:
        -v | --verbose
      | -O[0-3] | --opt-level=[0-3]
      | -warn-spills | --warn-on-spills
      | -warn-lmem-usage | --warn-on-local-memory-usage
      | -warn-double-usage | --warn-on-double-precision-use
      | --?maxrregcount=[0-9]{1,3}
      | -dlcm=(?:ca|cg|cs) | --def-load-cache=(?:ca|cg|cs)
      | -dscm=(?:wb|cg|cs|wt) | --def-store-cache=(?:wb|cg|cs|wt)
      | --allow-expensive-optimizations=(?:true|false)
      | -lineinfo | --generate-line-info
      | -Werror | --warning-as-error
    )""",
    re.VERBOSE | re.ASCII,
)

_FATBIN = frozenset({"-fatbin", "--fatbin"})
_CUBIN = frozenset({"-cubin", "--cubin"})
_INCLUDE_PREFIXES = ("--include-path=", "-I")

# Environment passed to nvcc: enough to find the host compiler and CUDA,
# nothing else (in particular not NVCC_PREPEND_FLAGS / NVCC_APPEND_FLAGS,
# which would smuggle flags past validate_options).
_ENV_KEEP = ("PATH", "LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_PATH", "HOME", "USER")


def validate_arch(arch: object) -> str:
    """
    Check an architecture string.

    @return: C{arch} unchanged.
    @raise ExecutionError: C{parse} unless C{arch} is a C{str} matching
        L{ARCH_RE}.
    """
    if not isinstance(arch, str):
        raise ExecutionError("parse", f"arch must be a string, got {type(arch).__name__}")
    if not ARCH_RE.fullmatch(arch):
        raise ExecutionError(
            "parse",
            f"invalid arch {arch!r}: expected sm_NN or compute_NN with an optional "
            "'a' or 'f' suffix, e.g. 'sm_90a'",
        )
    return arch


def _refuse_unsafe(flag: str, value: str, hint: str = "") -> None:
    """Refuse C{value} (of C{flag}) unless it holds only L{SAFE_VALUE_CHARS}."""
    if _SAFE_VALUE.fullmatch(value):
        return
    bad = "".join(sorted({c for c in value if not _SAFE_VALUE.fullmatch(c)}))
    raise ExecutionError(
        "parse",
        f"compiler flag not allowed: {flag!r}: its value holds {bad!r}; flag values may "
        f"only hold letters, digits and {SAFE_VALUE_CHARS[9:]!r} (nvcc passes them through "
        f"a shell){hint}",
    )


def _include_dir(value: str, workspace: str) -> str:
    if not value:
        raise ExecutionError("parse", "-I needs a directory")
    _refuse_unsafe("-I" + value, value)
    root = os.path.realpath(workspace)
    path = os.path.realpath(os.path.join(root, value))
    if path != root and not path.startswith(root.rstrip(os.sep) + os.sep):
        raise ExecutionError(
            "parse", f"include directory {value!r} is outside the workspace; use a relative path"
        )
    _refuse_unsafe("-I" + value, path)
    return path


def _macro_flag(flag: str, value: str | None) -> None:
    """Explain a refused C{-D}/C{--define-macro} whose definition is unsafe."""
    if value is None:
        text = flag.split("=", 1)[1] if flag.startswith("--define-macro=") else flag[2:]
        shown = flag
    else:
        text, shown = value, f"{flag} {value}"
    name, _, definition = text.partition("=")
    if re.fullmatch(_MACRO, name, re.ASCII):
        _refuse_unsafe(shown, definition, "; put such a macro in the source with #define")


def validate_options(options: object, workspace: str | None = None) -> tuple[list[str], bool]:
    """
    Check user-supplied compiler flags against an allowlist.

    Flags that choose files to write or change what is produced (C{-o},
    C{-odir}, C{--run}, C{-E}, C{-ptx}, C{-rdc}, C{-arch}, C{-gencode}, ...) are
    refused, and so is anything not listed in C{docs/compilers.md}. nvcc runs
    its sub-commands through C{/bin/sh}, so a value (a C{-D} definition, a
    C{-I} directory) may hold only L{SAFE_VALUE_CHARS}: no shell
    metacharacter.  Flags that would smuggle others past this list
    (C{-Xcompiler}, C{--options-file}, C{-ccbin}, ...) are not on it.

    @param options: a sequence of C{str}, one argument each.
    @param workspace: directory that C{-I} paths must stay inside; relative
        paths are resolved against it. Defaults to the current directory (the
        worker's workspace).

    @return: C{(args, fatbin)}: arguments to pass on (C{-I} rewritten to
        absolute paths, C{-fatbin}/C{-cubin} removed) and whether a fatbin was
        asked for.

    @raise ExecutionError: C{parse} naming the first offending flag.
    """
    if isinstance(options, (str, bytes)) or not isinstance(options, (tuple, list)):
        raise ExecutionError("parse", "compiler flags must be a list of strings")
    if workspace is None:
        workspace = os.getcwd()
    out: list[str] = []
    fatbin = False
    items = list(options)
    i = 0
    while i < len(items):
        flag = items[i]
        i += 1
        if not isinstance(flag, str):
            raise ExecutionError("parse", f"compiler flag must be a string, got {flag!r}")
        if flag in _FATBIN:
            fatbin = True
            continue
        if flag in _CUBIN:
            continue
        if _SINGLE.fullmatch(flag):
            out.append(flag)
            continue
        if flag in _PAIRED:
            if i >= len(items) or not isinstance(items[i], str):
                raise ExecutionError("parse", f"compiler flag {flag!r} needs a value")
            value = items[i]
            i += 1
            if not _PAIRED[flag].fullmatch(value):
                if flag in ("-D", "--define-macro"):
                    _macro_flag(flag, value)
                raise ExecutionError("parse", f"invalid value {value!r} for compiler flag {flag!r}")
            out += [flag, value]
            continue
        if flag in ("-I", "--include-path"):
            if i >= len(items) or not isinstance(items[i], str):
                raise ExecutionError("parse", f"compiler flag {flag!r} needs a directory")
            out.append("-I" + _include_dir(items[i], workspace))
            i += 1
            continue
        if flag.startswith(_INCLUDE_PREFIXES):
            prefix = next(p for p in _INCLUDE_PREFIXES if flag.startswith(p))
            out.append("-I" + _include_dir(flag[len(prefix) :], workspace))
            continue
        if flag in ("-Xptxas", "--ptxas-options") or flag.startswith(
            ("-Xptxas=", "--ptxas-options=")
        ):
            if "=" in flag:
                value = flag.split("=", 1)[1]
            else:
                if i >= len(items) or not isinstance(items[i], str):
                    raise ExecutionError("parse", f"compiler flag {flag!r} needs a value")
                value = items[i]
                i += 1
            for part in value.split(","):
                if not _PTXAS.fullmatch(part):
                    raise ExecutionError("parse", f"ptxas option not allowed: {part!r}")
            out += ["-Xptxas", value]
            continue
        if flag.startswith(("-D", "--define-macro=")):
            _macro_flag(flag, None)
        raise ExecutionError(
            "parse",
            f"compiler flag not allowed: {flag!r} (allowed: -O0..-O3, -lineinfo, -std=c++NN, "
            "-DNAME[=V], -UNAME, --use_fast_math, -I<dir in workspace>, -maxrregcount=N, "
            "-Xptxas <opts>, -fatbin, -g, -G, -W..., --ftz/--prec-div/--prec-sqrt/--fmad=bool)",
        )
    return out, fatbin


def shorten(text: str, limit: int = DIAGNOSTICS_LIMIT) -> str:
    """
    Shorten compiler output to about C{limit} characters, keeping both ends.

    The head holds the first (usually root-cause) errors with their line
    numbers; the tail holds nvcc's summary. Protocol section 9.3.
    """
    text = text.strip()
    if len(text) <= limit:
        return text
    omitted_marker = "\n[... {} characters omitted ...]\n"
    budget = max(limit - len(omitted_marker) - 6, 2)
    head = budget * 3 // 5
    tail = budget - head
    omitted = len(text) - head - tail
    return text[:head] + omitted_marker.format(omitted) + text[-tail:]


_VERSION_RE = re.compile(r"release (\d+\.\d+), V(\d+(?:\.\d+)*)")


def parse_nvcc_version(output: str) -> dict[str, str]:
    """
    Parse C{nvcc --version}.

    @return: C{{'nvcc': '13.0.88', 'cuda': '13.0'}}, or C{{}} if unrecognised.
    """
    match = _VERSION_RE.search(output)
    if match is None:
        return {}
    return {"nvcc": match.group(2), "cuda": match.group(1)}


def _executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def _wheel_candidates() -> list[str]:
    """nvcc locations inside the C{nvidia-cuda-nvcc} wheel, if installed."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    found = []
    for base in spec.submodule_search_locations:
        # 12.x wheels: nvidia/cuda_nvcc/bin/nvcc; 13.x wheels: nvidia/cu13/bin/nvcc.
        found.append(os.path.join(base, "cuda_nvcc", "bin", "nvcc"))
        try:
            names = sorted(os.listdir(base), reverse=True)
        except OSError:
            continue
        found += [os.path.join(base, n, "bin", "nvcc") for n in names if re.fullmatch(r"cu\d+", n)]
    return found


#: Where a CUDA toolkit installs nvcc by default: searched last.
STANDARD_LOCATIONS = ("/usr/local/cuda/bin/nvcc",)


def find_nvcc(environ: dict[str, str] | None = None) -> tuple[str | None, str]:
    """
    Locate nvcc: C{PATH}, then C{$CUDA_HOME/bin/nvcc} (or C{$CUDA_PATH}), then
    the C{nvidia-cuda-nvcc} wheel (the C{server} extra), then the toolkit's
    default place (L{STANDARD_LOCATIONS}).  The compile backends and the GPU
    worker both use this one search.

    @return: C{(path, '')} or C{(None, reason)}.
    """
    env = os.environ if environ is None else environ
    on_path = shutil.which("nvcc", path=env.get("PATH", os.defpath))
    if on_path:
        return on_path, ""
    tried = ["not on PATH"]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = env.get(var)
        if home:
            candidate = os.path.join(home, "bin", "nvcc")
            if _executable(candidate):
                return candidate, ""
            tried.append(f"not in ${var}/bin")
        else:
            tried.append(f"${var} is not set")
    for candidate in _wheel_candidates():
        if _executable(candidate):
            return candidate, ""
    tried.append("the nvidia-cuda-nvcc wheel is not installed (pip install 'kcoral[server]')")
    for candidate in STANDARD_LOCATIONS:
        if _executable(candidate):
            return candidate, ""
        tried.append(f"not at {candidate}")
    return None, "nvcc not found: " + ", ".join(tried)


#: C{nvcc --version} of each nvcc, keyed by its path and what C{stat}
#: says of the file (device, inode, size, mtime): a toolchain replaced in
#: place is probed again, an unchanged one never.
_probes: dict[tuple[str, int, int, int, int], dict[str, str]] = {}
_probes_lock = threading.Lock()


def _identity(path: str) -> tuple[str, int, int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def probe_versions(path: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """
    BLOCKING the first time: the versions of the nvcc at C{path} (see
    L{parse_nvcc_version}), probed once per toolchain: again only when the
    file at C{path} changes.

    @return: C{{}} when nvcc cannot be run or says nothing recognisable.
    """
    identity = _identity(path)
    if identity is None:
        return {}
    with _probes_lock:
        cached = _probes.get(identity)
    if cached is not None:
        return dict(cached)
    try:
        result = subprocess.run(
            [path, "--version"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            env=env,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return {}
    parsed = parse_nvcc_version(result.stdout.decode("utf-8", "replace"))
    if parsed:
        with _probes_lock:
            _probes[identity] = parsed
    return dict(parsed)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@implementer(IPlugin, ICompilerBackend, ICommandLineBackend)
@attrs.define(eq=False)
class NvccBackend:
    """
    Compile CUDA C to a cubin (or fatbin) with C{nvcc}; needs no GPU.

    @ivar nvcc_path: explicit nvcc to use; default: L{find_nvcc} at each call.
    @ivar workspace: directory C{-I} flags must stay in; default: the current
        directory at compile time (the worker's workspace).
    """

    name = "nvcc"
    kind = KIND_BINARY

    nvcc_path: str | None = None
    workspace: str | None = None

    def locate(self) -> tuple[str | None, str]:
        """
        @return: C{(path, '')} or C{(None, reason)}.
        """
        if self.nvcc_path is not None:
            if _executable(self.nvcc_path):
                return self.nvcc_path, ""
            return None, f"configured nvcc {self.nvcc_path!r} is not an executable file"
        return find_nvcc()

    def available(self) -> tuple[bool, str]:
        path, reason = self.locate()
        return (path is not None), reason

    def versions(self) -> dict[str, str]:
        path, _ = self.locate()
        if path is None:
            return {}
        return probe_versions(path, self._environment(path, None))

    def _environment(self, nvcc: str, tmpdir: str | None) -> dict[str, str]:
        env = {k: os.environ[k] for k in _ENV_KEEP if k in os.environ}
        env["PATH"] = os.pathsep.join([os.path.dirname(nvcc), env.get("PATH", os.defpath)])
        env["LC_ALL"] = "C"
        if tmpdir is not None:
            env["TMPDIR"] = tmpdir
        return env

    def command(
        self, source_path: str, output_path: str, arch: str, options: tuple[str, ...], tmpdir: str
    ) -> tuple[list[str], dict[str, str]]:
        validate_arch(arch)
        args, fatbin = validate_options(options, self.workspace)
        if arch.startswith("compute_"):
            fatbin = True  # a cubin cannot hold PTX; ship it in a fatbin
        nvcc, reason = self.locate()
        if nvcc is None:
            raise ExecutionError("unavailable", reason)
        argv = [nvcc, "-fatbin" if fatbin else "-cubin", f"-arch={arch}", *args]
        argv += ["-o", output_path, source_path]
        return argv, self._environment(nvcc, tmpdir)

    def compile(self, source: str, arch: str, options: tuple[str, ...], timeout: float) -> bytes:
        if not isinstance(source, str):
            raise ExecutionError(
                "parse", f"CUDA source must be a string, got {type(source).__name__}"
            )
        validate_arch(arch)
        validate_options(options, self.workspace)
        if not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ExecutionError(
                "parse", f"compile timeout must be a positive number, got {timeout!r}"
            )
        with tempfile.TemporaryDirectory(prefix="kcoral-nvcc-") as tmp:
            src = os.path.join(tmp, SOURCE_NAME)
            out = os.path.join(tmp, OUTPUT_NAME)
            argv, env = self.command(src, out, arch, options, tmp)
            with open(src, "w", encoding="utf-8") as f:
                f.write(source)
            text = run_nvcc(argv, cwd=tmp, env=env, arch=arch, timeout=timeout)
            try:
                with open(out, "rb") as f:
                    return f.read()
            except OSError:
                raise ExecutionError(
                    "compile", "nvcc succeeded but wrote no module image:\n" + shorten(text)
                ) from None


def run_nvcc(argv: list[str], *, cwd: str, env: dict[str, str], arch: str, timeout: float) -> str:
    """
    BLOCKING: run nvcc in C{cwd} in its own process group (killed as a whole
    on timeout or interruption), and turn a failure into an L{ExecutionError}
    whose message has C{cwd} stripped from the compiler's diagnostics.

    @return: the diagnostics of a successful run, C{cwd} stripped likewise.
    """
    try:
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    except OSError as e:
        raise ExecutionError("unavailable", f"cannot run nvcc: {e}") from None
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        proc.communicate()
        raise ExecutionError("compile", f"nvcc timed out after {timeout:g}s") from None
    except BaseException:
        _kill_group(proc)
        proc.communicate()
        raise
    text = output.decode("utf-8", "replace").replace(cwd + os.sep, "").replace(cwd, ".")
    if proc.returncode != 0:
        raise ExecutionError(
            "compile",
            f"nvcc failed for {arch} (exit status {proc.returncode}):\n"
            + (shorten(text) or "(no diagnostics)"),
        )
    return text
