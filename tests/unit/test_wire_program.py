"""
Tests for L{kcoral.wire.program}: one accepted and one rejected case for each
validation rule of protocol §4, in both dialects (§13.2).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from kcoral.wire.program import (
    DTYPES,
    BuiltinName,
    GetFunction,
    Options,
    Ref,
    Return,
    Run,
    Upload,
    ValidationError,
    clamp_options,
    dump_program,
    normalize_path,
    parse_program,
    tensor_nbytes,
)

H = "ab" * 32
EMPTY = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
MOD = {"op": "upload", "kind": "module", "source": "def f(): pass", "id": "m"}
FN = {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "f"}
RUN = {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": []}
RET = {"op": "return", "key": "k", "value": {"$ref": "r"}}


def prog(*instructions: dict[str, Any], **extra: Any) -> bytes:
    return json.dumps({"instructions": list(instructions), **extra}).encode()


def with_(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    out = {**base, **changes}
    return {k: v for k, v in out.items() if v is not DROP}


DROP = object()

# (case id, body bytes, expected message)
REJECTED: list[tuple[str, bytes, str]] = [
    # §4.1 strict JSON
    ("invalid-utf8", b'{"instructions":"\xff"}', "malformed JSON: "),
    ("bom", b"\xef\xbb\xbf" + prog(MOD), "malformed JSON: "),
    ("not-json", b"{", "malformed JSON: "),
    ("dup-key", b'{"instructions":[],"instructions":[]}', "duplicate JSON key: 'instructions'"),
    (
        "dup-key-nested",
        prog(with_(RUN, args=[]))[:-2] + b'],"options":{"a":1,"a":2}}',
        "duplicate JSON key: 'a'",
    ),
    ("nan", b'{"instructions":[NaN]}', "non-finite number NaN is not allowed"),
    ("infinity", b'{"instructions":[-Infinity]}', "non-finite number -Infinity is not allowed"),
    ("too-deep", b"[" * 100000, "malformed JSON: nesting too deep"),
    # §4.2 top level
    ("not-object", b"[]", "program must be a JSON object"),
    ("unknown-top", prog(MOD, b=1, a=2), "program has unknown field(s): a, b"),
    ("missing-instructions", b"{}", "program is missing field(s): instructions"),
    ("empty-instructions", prog(), "'instructions' must be a non-empty array"),
    ("instructions-object", b'{"instructions":{}}', "'instructions' must be a non-empty array"),
    ("options-before-instr", prog(7, options=None), "'options' must be an object"),
    # §4.3 options
    ("options-null", prog(MOD, options=None), "'options' must be an object"),
    ("options-unknown", prog(MOD, options={"x": 1}), "options has unknown field(s): x"),
    (
        "gpu-zero",
        prog(MOD, options={"gpu_count": 0}),
        "'gpu_count' must be an integer between 1 and 8",
    ),
    (
        "gpu-nine",
        prog(MOD, options={"gpu_count": 9}),
        "'gpu_count' must be an integer between 1 and 8",
    ),
    (
        "gpu-bool",
        prog(MOD, options={"gpu_count": True}),
        "'gpu_count' must be an integer between 1 and 8",
    ),
    (
        "gpu-float",
        prog(MOD, options={"gpu_count": 1.0}),
        "'gpu_count' must be an integer between 1 and 8",
    ),
    (
        "timeout-zero",
        prog(MOD, options={"timeout_seconds": 0}),
        "'timeout_seconds' must be a finite positive number",
    ),
    (
        "timeout-bool",
        prog(MOD, options={"timeout_seconds": True}),
        "'timeout_seconds' must be a finite positive number",
    ),
    (
        "timeout-overflow",
        prog(MOD)[:-1] + b',"options":{"timeout_seconds":1e400}}',
        "'timeout_seconds' must be a finite positive number",
    ),
    (
        "timeout-string",
        prog(MOD, options={"timeout_seconds": "1"}),
        "'timeout_seconds' must be a finite positive number",
    ),
    (
        "limit-negative",
        prog(MOD, options={"output_limit_bytes": -1}),
        "'output_limit_bytes' must be a non-negative integer",
    ),
    (
        "limit-float",
        prog(MOD, options={"output_limit_bytes": 1.5}),
        "'output_limit_bytes' must be a non-negative integer",
    ),
    (
        "limit-bool",
        prog(MOD, options={"output_limit_bytes": False}),
        "'output_limit_bytes' must be a non-negative integer",
    ),
    (
        "gpu-before-timeout",
        prog(MOD, options={"timeout_seconds": 0, "gpu_count": 0}),
        "'gpu_count' must be an integer between 1 and 8",
    ),
    ("options-win", prog(7, options={"x": 1}), "options has unknown field(s): x"),
    # §4.4 common
    ("instr-not-object", prog(MOD, 7), "instruction 1 must be an object"),
    ("unknown-op", prog(with_(MOD, op="exec")), "instruction 0: unknown op 'exec'"),
    ("missing-op", prog(with_(MOD, op=DROP)), "instruction 0: unknown op None"),
    ("missing-id", prog(with_(MOD, id=DROP)), "instruction 0 needs a non-empty string 'id'"),
    ("empty-id", prog(with_(MOD, id="")), "instruction 0 needs a non-empty string 'id'"),
    ("int-id", prog(with_(MOD, id=1)), "instruction 0 needs a non-empty string 'id'"),
    ("dup-id", prog(MOD, with_(FN, id="m")), "duplicate instruction id: 'm'"),
    ("unknown-field", prog(with_(MOD, zz=1, aa=2)), "instruction 0 has unknown field(s): aa, zz"),
    ("missing-field", prog(with_(MOD, source=DROP)), "instruction 0 is missing field(s): source"),
    (
        "unknown-before-missing",
        prog(with_(MOD, source=DROP, x=1)),
        "instruction 0 has unknown field(s): x",
    ),
    # §4.5 references
    (
        "ref-unknown",
        prog(MOD, with_(FN, module={"$ref": "zz"})),
        "'f' references unknown/forward handle 'zz'",
    ),
    (
        "ref-self",
        prog(MOD, FN, with_(RUN, fn={"$ref": "r"})),
        "'r' references unknown/forward handle 'r'",
    ),
    (
        "ref-forward",
        prog(MOD, with_(FN, module={"$ref": "r"}), RUN),
        "'f' references unknown/forward handle 'r'",
    ),
    (
        "arg-ref-unknown",
        prog(MOD, FN, with_(RUN, args=[{"$ref": "q"}])),
        "'r' references unknown/forward handle 'q'",
    ),
    (
        "arg-nonfinite",
        prog(MOD, FN)[:-2] + b',{"op":"run","id":"r","fn":{"$ref":"f"},"args":[[1e999]]}]}',
        "run 'r' argument contains a non-finite number",
    ),
    (
        "return-ref-unknown",
        prog(MOD, with_(RET, value={"$ref": "zz"})),
        "\"return 'k'\" references unknown/forward handle 'zz'",
    ),
    # §4.6 upload
    (
        "module-source-int",
        prog(with_(MOD, source=1)),
        "module upload 'm': 'source' must be a string",
    ),
    (
        "module-language-bad",
        prog(with_(MOD, language="rust")),
        "module upload 'm': unsupported language 'rust'",
    ),
    ("module-entry", prog(with_(MOD, entry="main")), "instruction 0 has unknown field(s): entry"),
    ("upload-unknown-kind", prog(with_(MOD, kind="zip")), "upload 'm': unknown kind 'zip'"),
    ("upload-missing-kind", prog(with_(MOD, kind=DROP)), "upload 'm': unknown kind None"),
    (
        "tensor-blob",
        prog(
            {
                "op": "upload",
                "kind": "tensor",
                "id": "t",
                "blob": H.upper(),
                "dtype": "float32",
                "shape": [],
            }
        ),
        "tensor upload 't': 'blob' must be a lowercase SHA-256 digest",
    ),
    (
        "tensor-dtype",
        prog(
            {"op": "upload", "kind": "tensor", "id": "t", "blob": H, "dtype": "uint16", "shape": []}
        ),
        "tensor upload 't': unsupported dtype 'uint16'",
    ),
    (
        "tensor-shape-neg",
        prog(
            {"op": "upload", "kind": "tensor", "id": "t", "blob": H, "dtype": "int8", "shape": [-1]}
        ),
        "tensor upload 't': 'shape' must be an array of non-negative integers",
    ),
    (
        "tensor-shape-bool",
        prog(
            {
                "op": "upload",
                "kind": "tensor",
                "id": "t",
                "blob": H,
                "dtype": "int8",
                "shape": [True],
            }
        ),
        "tensor upload 't': 'shape' must be an array of non-negative integers",
    ),
    (
        "tensor-missing",
        prog({"op": "upload", "kind": "tensor", "id": "t", "blob": H}),
        "instruction 0 is missing field(s): dtype, shape",
    ),
    (
        "bytes-blob",
        prog({"op": "upload", "kind": "bytes", "id": "b", "blob": "ab"}),
        "bytes upload 'b': 'blob' must be a lowercase SHA-256 digest",
    ),
    (
        "bytes-extra",
        prog({"op": "upload", "kind": "bytes", "id": "b", "blob": H, "path": "x"}),
        "instruction 0 has unknown field(s): path",
    ),
    (
        "library-blob",
        prog({"op": "upload", "kind": "library", "id": "l", "blob": 5}),
        "library upload 'l': 'blob' must be a lowercase SHA-256 digest",
    ),
    (
        "file-blob",
        prog({"op": "upload", "kind": "file", "id": "p", "blob": "x", "path": "a"}),
        "file upload: 'blob' must be a lowercase SHA-256 digest",
    ),
    (
        "file-idless-blob",
        prog({"op": "upload", "kind": "file", "blob": "x", "path": "a"}),
        "file upload: 'blob' must be a lowercase SHA-256 digest",
    ),
    (
        "idless-bytes",
        prog({"op": "upload", "kind": "bytes", "blob": H}),
        "instruction 0 needs a non-empty string 'id'",
    ),
    (
        "file-id-null",
        prog({"op": "upload", "kind": "file", "id": None, "blob": H, "path": "a"}),
        "instruction 0 needs a non-empty string 'id'",
    ),
    (
        "idless-file-no-handle",
        prog(
            {"op": "upload", "kind": "file", "blob": H, "path": "a"}, with_(RUN, fn={"$ref": "a"})
        ),
        "'r' references unknown/forward handle 'a'",
    ),
    # §4.7 get_function
    (
        "gf-module-string",
        prog(MOD, with_(FN, module="m")),
        "get_function 'f': 'module' must be {'$ref': id}",
    ),
    (
        "gf-module-extra",
        prog(MOD, with_(FN, module={"$ref": "m", "x": 1})),
        "get_function 'f': 'module' must be {'$ref': id}",
    ),
    (
        "gf-name-empty",
        prog(MOD, with_(FN, name="")),
        "get_function 'f': 'name' must be a non-empty string",
    ),
    (
        "gf-cpu-only",
        prog(MOD, with_(FN, cpu_only=1)),
        "get_function 'f': 'cpu_only' must be a boolean",
    ),
    ("gf-unknown", prog(MOD, with_(FN, extra=1)), "instruction 1 has unknown field(s): extra"),
    # §4.8 run
    (
        "run-fn-string",
        prog(MOD, FN, with_(RUN, fn="builtin.zeros")),
        "run 'r': 'fn' must be {'$ref': id}",
    ),
    (
        "run-fn-empty-ref",
        prog(MOD, FN, with_(RUN, fn={"$ref": ""})),
        "run 'r': 'fn' must be {'$ref': id}",
    ),
    ("run-args-object", prog(MOD, FN, with_(RUN, args={})), "run 'r': 'args' must be an array"),
    ("run-missing-fn", prog(MOD, FN, with_(RUN, fn=DROP)), "instruction 2 is missing field(s): fn"),
    # §4.9 return
    (
        "ret-key-empty",
        prog(MOD, with_(RET, key="", value={"$ref": "m"})),
        "return instruction 1 needs a non-empty string 'key'",
    ),
    (
        "ret-key-dup",
        prog(MOD, with_(RET, value={"$ref": "m"}), with_(RET, value={"$ref": "m"})),
        "duplicate return key: 'k'",
    ),
    (
        "ret-value-literal",
        prog(MOD, with_(RET, value="m")),
        "return 'k': 'value' must be {'$ref': id}",
    ),
    (
        "ret-both",
        prog(
            MOD, {"op": "return", "key": "k", "kind": "file", "path": "a", "value": {"$ref": "m"}}
        ),
        "instruction 1 has unknown field(s): value",
    ),
    (
        "ret-kind",
        prog(MOD, {"op": "return", "key": "k", "kind": "dir", "path": "a"}),
        "return 'k': unknown kind 'dir'",
    ),
    (
        "ret-path-dot",
        prog(MOD, {"op": "return", "key": "k", "kind": "folder", "path": "."}),
        "filesystem 'path' must name a file or folder",
    ),
    (
        "ret-path-empty",
        prog(MOD, {"op": "return", "key": "k", "kind": "file", "path": ""}),
        "filesystem 'path' must be a non-empty string",
    ),
    (
        "ret-missing-value",
        prog(MOD, {"op": "return", "key": "k"}),
        "instruction 1 is missing field(s): value",
    ),
    # §4.10 paths and conflicts
    (
        "path-dup",
        prog(
            {"op": "upload", "kind": "file", "id": "a", "blob": H, "path": "x/y"},
            {"op": "upload", "kind": "file", "id": "b", "blob": H, "path": "./x//y"},
        ),
        "duplicate file upload path: 'x/y'",
    ),
    (
        "path-conflict",
        prog(
            {"op": "upload", "kind": "file", "id": "a", "blob": H, "path": "a/b"},
            {"op": "upload", "kind": "file", "id": "b", "blob": H, "path": "a-b"},
            {"op": "upload", "kind": "file", "blob": H, "path": "a"},
        ),
        "conflicting file upload paths: 'a' and 'a/b'",
    ),
]

ACCEPTED: list[tuple[str, bytes]] = [
    ("minimal", prog(MOD)),
    (
        "non-ascii",
        json.dumps(
            {"instructions": [with_(MOD, source="print('ü')")]}, ensure_ascii=False
        ).encode(),
    ),
    ("overflow-in-unused-literal-ok", prog(MOD, FN, with_(RUN, args=[1e300]))),
    (
        "options-all",
        prog(
            MOD, options={"gpu_count": 8, "timeout_seconds": 1e9, "output_limit_bytes": 268435456}
        ),
    ),
    ("options-empty", prog(MOD, options={})),
    ("gpu-one", prog(MOD, options={"gpu_count": 1})),
    ("timeout-int", prog(MOD, options={"timeout_seconds": 1})),
    ("limit-zero", prog(MOD, options={"output_limit_bytes": 0})),
    ("id-any-chars", prog(with_(MOD, id="a b/ü:$"))),
    ("module-empty-source", prog(with_(MOD, source=""))),
    ("module-language-python", prog(with_(MOD, language="python"))),
    ("module-language-cuda", prog(with_(MOD, language="cuda"))),
    (
        "tensor-scalar",
        prog(
            {
                "op": "upload",
                "kind": "tensor",
                "id": "t",
                "blob": H,
                "dtype": "bfloat16",
                "shape": [],
            }
        ),
    ),
    (
        "tensor-zero-dim",
        prog(
            {
                "op": "upload",
                "kind": "tensor",
                "id": "t",
                "blob": EMPTY,
                "dtype": "bool",
                "shape": [0, 3],
            }
        ),
    ),
    ("bytes", prog({"op": "upload", "kind": "bytes", "id": "b", "blob": EMPTY})),
    ("library", prog({"op": "upload", "kind": "library", "id": "l", "blob": H})),
    ("file", prog({"op": "upload", "kind": "file", "id": "p", "blob": H, "path": "./data//t.bin"})),
    ("file-idless", prog({"op": "upload", "kind": "file", "blob": H, "path": "a"})),
    (
        "same-blob-many-kinds",
        prog(
            {"op": "upload", "kind": "bytes", "id": "b", "blob": H},
            {"op": "upload", "kind": "file", "id": "p", "blob": H, "path": "a"},
        ),
    ),
    ("gf-dots", prog(MOD, with_(FN, name="a.b.c", cpu_only=True))),
    (
        "gf-any-handle",
        prog(
            {"op": "upload", "kind": "bytes", "id": "b", "blob": H}, with_(FN, module={"$ref": "b"})
        ),
    ),
    ("run-no-args", prog(MOD, FN, with_(RUN, args=DROP))),
    (
        "run-nested-ref-literal",
        prog(MOD, FN, with_(RUN, args=[[{"$ref": "zz"}], {"$ref": "m", "k": 1}, {"$ref": ""}])),
    ),
    (
        "run-fn-returned-callable",
        prog(MOD, FN, RUN, with_(RUN, id="r2", fn={"$ref": "r"}, args=[{"$ref": "f"}])),
    ),
    ("ret-key-equals-id", prog(MOD, with_(RET, key="m", value={"$ref": "m"}))),
    (
        "ret-file-ref",
        prog(MOD, {"op": "return", "key": "k", "kind": "file", "path": {"$ref": "m"}}),
    ),
    (
        "ret-folder-literal",
        prog(MOD, {"op": "return", "key": "k", "kind": "folder", "path": "out/"}),
    ),
    (
        "paths-siblings",
        prog(
            {"op": "upload", "kind": "file", "id": "a", "blob": H, "path": "a"},
            {"op": "upload", "kind": "file", "id": "b", "blob": H, "path": "a-b"},
            {"op": "upload", "kind": "file", "id": "c", "blob": H, "path": "ab/c"},
        ),
    ),
    (
        "return-path-not-conflict",
        prog(
            {"op": "upload", "kind": "file", "id": "a", "blob": H, "path": "a"},
            {"op": "return", "key": "k", "kind": "file", "path": "a"},
        ),
    ),
]


@pytest.mark.parametrize(
    ("body", "message"), [c[1:] for c in REJECTED], ids=[c[0] for c in REJECTED]
)
def test_rejected(body: bytes, message: str) -> None:
    """Each rule rejects its broken case with the reference message."""
    with pytest.raises(ValidationError) as info:
        parse_program(body)
    if message.endswith(": "):
        assert info.value.message.startswith(message)
    else:
        assert info.value.message == message


@pytest.mark.parametrize("body", [c[1] for c in ACCEPTED], ids=[c[0] for c in ACCEPTED])
def test_accepted(body: bytes) -> None:
    """Each rule accepts its valid case, and the dump parses back equal."""
    program = parse_program(body)
    assert parse_program(json.dumps(dump_program(program)).encode()) == program


def test_builtin_string_fn() -> None:
    """A string C{fn} is accepted only when it names a known builtin."""
    body = prog(with_(RUN, fn="builtin.zeros", args=[{"shape": [4]}]))
    program = parse_program(body, builtin_names=frozenset({"builtin.zeros"}))
    run = program.instructions[0]
    assert isinstance(run, Run) and run.fn == BuiltinName("builtin.zeros")
    with pytest.raises(ValidationError, match=r"run 'r': 'fn' must be \{'\$ref': id\}"):
        parse_program(body, builtin_names=frozenset({"builtin.randn"}))


def test_model_fields() -> None:
    """The parsed model carries normalized paths, tuples and resolved refs."""
    program = parse_program(
        prog(
            MOD,
            {"op": "upload", "kind": "file", "blob": H, "path": "./d//x"},
            {"op": "upload", "kind": "tensor", "id": "t", "blob": H, "dtype": "int8", "shape": [2]},
            FN,
            with_(RUN, args=[{"$ref": "t"}, {"x": {"$ref": "t"}}, 1.5]),
            RET,
            {"op": "return", "key": "d", "kind": "folder", "path": "d/"},
            options={"timeout_seconds": 3, "output_limit_bytes": 5},
        )
    )
    m, f, t, g, r, k, d = program.instructions
    assert m == Upload(index=0, id="m", kind="module", source="def f(): pass")
    assert f == Upload(index=1, id=None, kind="file", blob=H, path="d/x")
    assert t == Upload(index=2, id="t", kind="tensor", blob=H, dtype="int8", shape=(2,))
    assert g == GetFunction(index=3, id="f", module=Ref("m"), name="f")
    assert r == Run(index=4, id="r", fn=Ref("f"), args=(Ref("t"), {"x": {"$ref": "t"}}, 1.5))
    assert k == Return(index=5, key="k", value=Ref("r"))
    assert d == Return(index=6, key="d", kind="folder", path="d")
    assert program.options == Options(timeout_seconds=3.0, output_limit_bytes=5)
    assert isinstance(program.options.timeout_seconds, float)
    assert program.referenced_blobs() == (H,)
    assert program.blob_kinds(H) == frozenset({"file", "tensor"})


@pytest.mark.parametrize(
    ("path", "normalized"),
    [
        ("./data//tensor.bin", "data/tensor.bin"),
        ("dir/", "dir"),
        ("a/./b", "a/b"),
        ("é" * 127, "é" * 127),
    ],
)
def test_normalize_path_accepts(path: str, normalized: str) -> None:
    """Paths are canonicalized as in §4.10's examples."""
    assert normalize_path(path) == normalized


@pytest.mark.parametrize(
    ("path", "message"),
    [
        (None, "must be a non-empty string"),
        ("", "must be a non-empty string"),
        ("a\x00b", "must not contain NUL"),
        ("a\\b", "must use POSIX '/' separators"),
        ("/etc/passwd", "must be relative"),
        ("a/../b", "must not contain a '..' component"),
        ("./", "must name a file or folder"),
        ("x" * 256, "contains a component longer than 255 bytes"),
        ("é" * 128, "contains a component longer than 255 bytes"),
        ("/".join(["x" * 200] * 21), "is longer than 4096 bytes"),
    ],
)
def test_normalize_path_rejects(path: object, message: str) -> None:
    """Each path rule has its own message, checked in the reference order."""
    with pytest.raises(ValidationError) as info:
        normalize_path(path)
    assert info.value.message == f"filesystem 'path' {message}"


def test_dtypes_and_nbytes() -> None:
    """The dtype table has the twelve names and sizes of §4.11."""
    assert len(DTYPES) == 12
    assert tensor_nbytes("float16", [32, 128]) == 8192
    assert tensor_nbytes("int64", []) == 8
    assert tensor_nbytes("bool", [0, 7]) == 0
    with pytest.raises(ValidationError):
        tensor_nbytes("complex64", [1])


def test_clamp_options() -> None:
    """Defaults fill absent options; large values are clamped, not rejected."""
    kw = dict(
        default_timeout=300.0,
        max_timeout=900.0,
        default_output_limit=1 << 20,
        max_output_limit=1 << 24,
    )
    assert clamp_options(Options(), **kw) == (300.0, 1 << 20)  # type: ignore[arg-type]
    assert clamp_options(Options(timeout_seconds=1e9, output_limit_bytes=1 << 28), **kw) == (
        900.0,
        1 << 24,
    )  # type: ignore[arg-type]
    assert clamp_options(Options(timeout_seconds=0.5, output_limit_bytes=0), **kw) == (0.5, 0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "body",
    [
        b'{"instructions": [{"op": {"run": 1}, "id": "a"}]}',
        b'{"instructions": [{"op": ["run"], "id": "a"}]}',
        b'{"instructions": [{"op": "return", "key": "k", "value": ' + b"9" * 5000 + b"}]}",
        b'{"instructions": [{"op": "return", "key": "k", "value": 1}], '
        b'"options": {"timeout_seconds": ' + b"9" * 4000 + b"}}",
    ],
    ids=["op-object", "op-array", "int-5000-digits", "timeout-4000-digits"],
)
def test_hostile_values_are_validation_errors(body: bytes) -> None:
    """Values that once raised TypeError/ValueError/OverflowError (a 500) are 400s."""
    with pytest.raises(ValidationError):
        parse_program(body)
