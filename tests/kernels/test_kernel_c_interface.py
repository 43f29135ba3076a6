"""The CPU kernels' declared interface (kernels/switchyard_kernels.h) against both sides: the C sources (each
includes it, none declares a prototype or a shared constant of its own, the compiler finds no exported
function missing from it), the compiled library (its sizes, offsets and constants, reported by cpu_abi.c) and
the Python side (ctypes Structures, constants, the functions the wrappers call and their argument counts)."""
from __future__ import annotations

import ast
import ctypes
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kernels import cpu_decode, cpu_lowp, cpu_native, native_interface
from tests.kernels.native_setup import native_on, needs_compiler  # noqa: F401  (autouse fixture)

KERNELS = Path(cpu_native.__file__).parent
ROOT = KERNELS.parent
HEADER_NAME = native_interface.HEADER.name

# Each constant of the header and the Python name that mirrors it (module, attribute).
PYTHON_CONSTANTS = {
    "SY_MAX_Q_HEADS": (cpu_native, "MAX_Q_HEADS"),
    "SY_MAX_HEAD_DIM": (cpu_native, "MAX_HEAD_DIM"),
    "SY_MAX_BLOCK_ROW": (cpu_native, "MAX_BLOCK_ROW"),
    "SY_AMX_KEY_CHUNK": (cpu_native, "AMX_KEY_CHUNK"),
    "SY_PANEL_N": (cpu_native, "PANEL_N"),
    "SY_QBLOCK": (cpu_lowp, "QBLOCK"),
    "SY_GROUP_Q8": (cpu_lowp, "GROUP_Q8"),
    "SY_GROUP_BF16": (cpu_lowp, "GROUP_BF16"),
    "SY_FEATURE_VNNI": (cpu_lowp, "FEATURE_VNNI"),
    "SY_FEATURE_BF16": (cpu_lowp, "FEATURE_BF16"),
    "SY_FEATURE_AVX512_BF16": (cpu_lowp, "FEATURE_AVX512_BF16"),
    "SY_FEATURE_AMX_BF16": (cpu_lowp, "FEATURE_AMX_BF16"),
    "SY_PROJ_F32_PANELS": (cpu_decode, "_F32_PANELS"),
    "SY_PROJ_INT8": (cpu_decode, "_INT8"),
    "SY_PROJ_INT4": (cpu_decode, "_INT4"),
    "SY_PROJ_BF16": (cpu_decode, "_BF16_STRIPS"),
    "SY_ERR_BLOCK": (cpu_decode, "_ERR_BLOCK"),
    "SY_ERR_TABLE": (cpu_decode, "_ERR_TABLE"),
    "SY_ERR_POSITION": (cpu_decode, "_ERR_POSITION"),
    "SY_ERR_SLOT": (cpu_decode, "_ERR_SLOT"),
    "SY_ERR_NO_HEAD": (cpu_decode, "_ERR_NO_HEAD"),
    "SY_ERR_TOKEN": (cpu_decode, "_ERR_TOKEN"),
}
# The C structs and the ctypes Structures that mirror them.
PYTHON_STRUCTS = {"sy_proj": cpu_decode._Proj, "sy_layer": cpu_decode._Layer, "sy_model": cpu_decode._Model}
# Python modules that call into the library.
CALLERS = ("cpu_native.py", "cpu_lowp.py", "cpu_decode.py")


def _sources() -> dict[Path, str]:
    return {path: path.read_text() for path in sorted(KERNELS.glob("*.c"))}


def _without_comments(text: str) -> str:
    return re.sub(r"/\*.*?\*/|//[^\n]*", " ", text, flags=re.DOTALL)


def test_every_source_is_built_and_includes_the_header():
    assert set(cpu_native.SOURCES) == set(KERNELS.glob("*.c"))
    assert set(cpu_native.HEADERS) == set(KERNELS.glob("*.h"))  # hashed into the build's cache key
    for path, text in _sources().items():
        assert f'#include "{HEADER_NAME}"' in text, f"{path.name} does not include {HEADER_NAME}"


def test_no_source_declares_what_the_header_declares():
    declared = native_interface.prototypes()
    shared = native_interface.constants()
    for path, text in _sources().items():
        code = _without_comments(text)
        # a prototype at file scope: `type sy_name(...);` (definitions end in `{`)
        own = re.findall(r"^[A-Za-z_][\w \t*]*?\b(sy_\w+)\s*\([^()]*\)\s*;", code, flags=re.MULTILINE)
        assert not own, f"{path.name} declares {own}: their prototypes belong in {HEADER_NAME}"
        for name in shared:
            bare = name.removeprefix("SY_")
            assert not re.search(rf"#define\s+(SY_)?{bare}\b|\b(SY_)?{bare}\s*=\s*-?\d", code), \
                f"{path.name} defines {name} again (it is {HEADER_NAME}'s)"
        for name in re.findall(r"^(?!static)[A-Za-z_][\w \t*]*?\b(sy_\w+)\s*\([^()]*\)\s*\{", code, flags=re.MULTILINE):
            assert name in declared, f"{path.name} exports {name}, which {HEADER_NAME} does not declare"


def _compiler() -> str:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang") or "cc"


@needs_compiler
@pytest.mark.parametrize("target", [["-march=native", "-fopenmp"], ["-march=x86-64"]], ids=["native", "baseline"])
def test_the_compiler_finds_every_exported_function_in_the_header(target):
    """-Werror=missing-prototypes: a non-static function with no prototype in scope (i.e. not in the header) is
    an error; a definition that disagrees with its header prototype always is. Both the vector code and the
    plain fallbacks (another -march) are checked."""
    if os.uname().machine not in ("x86_64", "AMD64"):
        target = [t for t in target if not t.startswith("-march")]
    done = subprocess.run([_compiler(), "-fsyntax-only", "-std=gnu11", "-Werror=missing-prototypes",
                           "-Werror=implicit-function-declaration", *target, *map(str, cpu_native.SOURCES)],
                          check=False, capture_output=True, text=True, timeout=240, cwd=KERNELS)
    assert done.returncode == 0, done.stderr[-4000:]


def _abi(lib: ctypes.CDLL) -> dict[str, int]:
    entries = {lib.sy_abi_name(i).decode(): int(lib.sy_abi_value(i)) for i in range(lib.sy_abi_count())}
    assert len(entries) == lib.sy_abi_count(), "an entry of cpu_abi.c's table is listed twice"
    return entries


@needs_compiler
def test_structures_match_the_build():
    lib = cpu_native.library()
    assert lib is not None, cpu_native.unavailable_reason()
    abi = _abi(lib)
    header = native_interface.structs()
    assert set(header) == set(PYTHON_STRUCTS)
    for name, structure in PYTHON_STRUCTS.items():
        c_fields = [re.fullmatch(rf"offsetof\({name}, (\w+)\)", key) for key in abi]
        c_fields = [m.group(1) for m in c_fields if m]
        py_fields = [field for field, _ in structure._fields_]
        assert c_fields == list(header[name]), f"cpu_abi.c's {name} fields differ from {HEADER_NAME}'s"
        assert py_fields == list(header[name]), f"{structure.__name__}'s fields differ from {HEADER_NAME}'s {name}"
        assert ctypes.sizeof(structure) == abi[f"sizeof({name})"], name
        for field in py_fields:
            assert getattr(structure, field).offset == abi[f"offsetof({name}, {field})"], f"{name}.{field}"


@needs_compiler
def test_constants_match_the_build_and_python():
    lib = cpu_native.library()
    assert lib is not None, cpu_native.unavailable_reason()
    built = {k: v for k, v in _abi(lib).items() if not k.startswith(("sizeof(", "offsetof("))}
    header = native_interface.constants()
    assert built == header, "cpu_abi.c reports other constants than the header declares"
    assert set(PYTHON_CONSTANTS) == set(header), "a header constant has no Python counterpart listed here"
    for name, (module, attribute) in PYTHON_CONSTANTS.items():
        assert getattr(module, attribute) == header[name], f"{module.__name__}.{attribute} != {name}"


@needs_compiler
def test_the_library_has_every_declared_function_with_its_header_signature():
    lib = cpu_native.library()
    assert lib is not None, cpu_native.unavailable_reason()
    for proto in native_interface.prototypes().values():
        function = getattr(lib, proto.name)
        assert (function.restype, function.argtypes) == native_interface.signature(proto), proto.name


def test_python_calls_only_declared_functions_with_their_argument_counts():
    declared = native_interface.prototypes()
    calls = 0
    for name in CALLERS:
        tree = ast.parse((KERNELS / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("sy_"):
                assert node.attr in declared, f"{name}:{node.lineno} uses {node.attr}, not in {HEADER_NAME}"
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr.startswith("sy_")):
                params = len(declared[node.func.attr].params)
                given = [a for a in node.args if not isinstance(a, ast.Starred)]
                if len(given) == len(node.args):
                    assert len(given) == params, f"{name}:{node.lineno}: {node.func.attr} takes {params} arguments"
                else:
                    assert len(given) < params, f"{name}:{node.lineno}: {node.func.attr} takes {params} arguments"
                calls += 1
    assert calls >= 20  # the wrappers' direct calls were all seen


SAMPLE = """
/* a comment with sy_fake(int x); inside */
int64_t sy_one(const float *x, int64_t n,
               const volatile int32_t *flag, float eps);
void *sy_two(void);
const char *sy_three(int i);
typedef struct {
    int32_t a, b; /* two */
    const float *p, *q;
    sy_inner nested;
} sy_sample;
#define SY_LIMIT 12
enum { SY_A = 1, SY_B = -2 };
"""


def test_the_header_reader_on_its_format():
    text = native_interface._COMMENT.sub(" ", SAMPLE)
    protos = native_interface.prototypes(text)
    assert list(protos) == ["sy_one", "sy_two", "sy_three"]
    assert protos["sy_one"].params == ("const float *", "int64_t", "const volatile int32_t *", "float")
    assert native_interface.signature(protos["sy_one"]) == (
        ctypes.c_int64, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float])
    assert native_interface.signature(protos["sy_two"]) == (ctypes.c_void_p, [])
    assert native_interface.signature(protos["sy_three"]) == (ctypes.c_char_p, [ctypes.c_int])
    assert native_interface.structs(text) == {"sy_sample": ("a", "b", "p", "q", "nested")}
    assert native_interface.constants(text) == {"SY_LIMIT": 12, "SY_A": 1, "SY_B": -2}


@pytest.mark.parametrize("declaration", ["double sy_x(int a);", "int sy_x(struct s v);", "int sy_x(int);",
                                         "int sy_x(unsigned long n);", "int sy_x(void v);"])
def test_the_header_reader_refuses_what_is_outside_its_format(declaration):
    with pytest.raises(ValueError, match="sy_x"):
        for proto in native_interface.prototypes(declaration).values():
            native_interface.signature(proto)


@needs_compiler
def test_a_header_the_library_does_not_match_is_an_error():
    lib = cpu_native.library()
    assert lib is not None, cpu_native.unavailable_reason()
    with pytest.raises(RuntimeError, match="sy_not_built"):
        native_interface.declare(lib, "int sy_decode_plan_ok(const void *m);\nint sy_not_built(void);\n")
