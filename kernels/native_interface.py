"""The CPU kernels' declared interface, read from kernels/switchyard_kernels.h: the exported functions'
prototypes (cpu_native sets every ctypes signature from them, so no argument list is typed twice), the
structs' field names and the shared constants (tests/kernels/test_kernel_c_interface.py compares these with
the Python side and with what the compiled library reports). The header keeps to a small format, described
in its opening comment; a declaration outside it is an error here, never a guess.
"""
from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from pathlib import Path

HEADER = Path(__file__).with_name("switchyard_kernels.h")

_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.DOTALL)
_PROTOTYPE = re.compile(r"^(?P<ret>[A-Za-z_][\w \t*]*?)\s*\b(?P<name>sy_\w+)\s*\((?P<params>[^()]*)\)\s*;",
                        re.MULTILINE)
_STRUCT = re.compile(r"typedef\s+struct\s*\{(?P<body>[^{}]*)\}\s*(?P<name>\w+)\s*;")
_DEFINE = re.compile(r"^#define\s+(?P<name>SY_\w+)\s+(?P<value>-?\d+)\s*$", re.MULTILINE)
_ENUM = re.compile(r"\benum\s*\{(?P<body>[^{}]*)\}\s*;")
_PARAM = re.compile(r"^(?P<type>.*?)\s*\b(?P<name>[A-Za-z_]\w*)$", re.DOTALL)
_QUALIFIERS = ("const", "volatile")
_SCALARS = {"void": None, "int": ctypes.c_int, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64,
            "float": ctypes.c_float}


@dataclass(frozen=True, slots=True)
class Prototype:
    name: str
    restype: str  # the C type as written, spaces normalized: "int64_t", "void *", "const char *"
    params: tuple[str, ...]  # the parameters' C types, names dropped; () for (void)


def read_header(path: Path = HEADER) -> str:
    """The header without its comments."""
    return _COMMENT.sub(" ", path.read_text())


def _c_type(text: str) -> str:
    return " ".join(text.replace("*", " * ").split()).replace("* *", "**")


def _params(name: str, text: str) -> tuple[str, ...]:
    text = " ".join(text.split())
    if text == "void":
        return ()
    types = []
    for part in text.split(","):
        match = _PARAM.match(part.strip())
        if match is None or not match["type"]:
            raise ValueError(f"{HEADER.name}: {name}: parameter {part.strip()!r} has no type and name")
        types.append(_c_type(match["type"]))
    return tuple(types)


def prototypes(text: str | None = None) -> dict[str, Prototype]:
    """Every sy_* prototype of the header (text: the header without comments, as read_header gives)."""
    text = read_header() if text is None else text
    found: dict[str, Prototype] = {}
    for match in _PROTOTYPE.finditer(text):
        name = match["name"]
        if name in found:
            raise ValueError(f"{HEADER.name}: {name} is declared twice")
        found[name] = Prototype(name, _c_type(match["ret"]), _params(name, match["params"]))
    return found


def ctype(c_type: str, *, returned: bool = False, where: str = "") -> type | None:
    """The ctypes type of a C type of the header's format: any pointer is an address (c_void_p), but a
    returned `const char *` is a string; void (returned only) is None."""
    words = c_type.split()
    if "*" in c_type:
        if returned and [w for w in words if w not in _QUALIFIERS] == ["char", "*"]:
            return ctypes.c_char_p
        return ctypes.c_void_p
    base = [w for w in words if w not in _QUALIFIERS]
    if len(base) != 1 or base[0] not in _SCALARS or (base[0] == "void" and not returned):
        raise ValueError(f"{HEADER.name}: {where}: type {c_type!r} is outside the header's format "
                         f"({', '.join(_SCALARS)} or a pointer)")
    return _SCALARS[base[0]]


def signature(proto: Prototype) -> tuple[type | None, list[type]]:
    """(restype, argtypes) for ctypes."""
    restype = ctype(proto.restype, returned=True, where=proto.name)
    return restype, [ctype(t, where=proto.name) for t in proto.params]  # type: ignore[misc]


def declare(lib: ctypes.CDLL, text: str | None = None) -> int:
    """Set every declared function's ctypes signature on `lib`; the number set. RuntimeError when the library
    lacks one (a header newer than the build), ValueError for a declaration outside the format."""
    declared = prototypes(text)
    for proto in declared.values():
        try:
            function = getattr(lib, proto.name)
        except AttributeError:
            raise RuntimeError(f"{lib._name}: no {proto.name}, which {HEADER.name} declares") from None
        function.restype, function.argtypes = signature(proto)
    return len(declared)


def structs(text: str | None = None) -> dict[str, tuple[str, ...]]:
    """Each `typedef struct { ... } name;` of the header: its field names in order."""
    text = read_header() if text is None else text
    found = {}
    for match in _STRUCT.finditer(text):
        fields = []
        for declaration in filter(None, (d.strip() for d in match["body"].split(";"))):
            for part in declaration.split(","):
                name = re.search(r"([A-Za-z_]\w*)\s*$", part)
                if name is None:
                    raise ValueError(f"{HEADER.name}: {match['name']}: cannot read field {part.strip()!r}")
                fields.append(name.group(1))
        found[match["name"]] = tuple(fields)
    return found


def constants(text: str | None = None) -> dict[str, int]:
    """The header's integer constants: `#define SY_NAME value` and enum members (each with its value
    written)."""
    text = read_header() if text is None else text
    found = {m["name"]: int(m["value"]) for m in _DEFINE.finditer(text)}
    for match in _ENUM.finditer(text):
        for member in filter(None, (m.strip() for m in match["body"].split(","))):
            name, sep, value = (s.strip() for s in member.partition("="))
            if not sep or not re.fullmatch(r"-?\d+", value):
                raise ValueError(f"{HEADER.name}: enum member {member!r} needs an explicit integer value")
            found[name] = int(value)
    return found
