"""Reading files that may come from someone else: one layer for plans, timelines, profiles, checkpoints.

Every file mpipar reads (a plan, a timeline, a hardware profile, a checkpoint's ``metadata.json``,
a checkpoint chunk) may have been written by someone else, truncated by a crash, or made to hurt.
This module is the single door they come through:

* ``open_regular`` opens only a regular file (never a FIFO, a device or a directory, so a read
  cannot block for ever), optionally only inside a given directory (resolved path checked, so
  neither ``..`` nor an absolute name nor a symlink can lead outside it);
* ``read_bounded`` reads at most a size cap;
* ``parse_json`` decodes UTF-8 JSON with a depth cap and bounded numbers: integers of at most
  ``MAX_INT_DIGITS`` digits, finite floats only, no ``NaN``/``Infinity``, no key repeated
  within one object;
* ``printable`` makes a file's text safe for a terminal: control characters (escape
  sequences, carriage returns, newlines that would forge a line), format characters (bidi
  overrides) and lone surrogates are written as ``\\x1b``, ``\\u202e``, ``\\ud800``; every CLI that
  prints a name read from a file passes it through here;
* every refusal is a ``FileFormatError`` (a ``ValueError``) naming the kind of file, the file, the
  field and the value, never a ``RecursionError``, ``UnicodeDecodeError`` or an ``int`` conversion
  error from deep inside the standard library.

Format-specific checks (a plan's meshes, a checkpoint's boxes) build on these and raise the same
error type (``PlanFormatError`` and ``TimelineFormatError`` are other names of it, ``CheckpointError`` a subclass).
"""

from __future__ import annotations

import json
import math
import os
import stat
from typing import IO, Any

MAX_JSON_BYTES = 256 << 20
"""Larger JSON files (plans, timelines, profiles) are refused before parsing (a 64-rank GPT plan
is 0.9 MB, a 1024-rank one some 15 MB). With ``MEMORY_FACTOR`` this bounds the memory a file
can make parsing take at 48 x 256 MiB = 12 GiB; files mpipar writes take 4-7x their size."""
MEMORY_FACTOR = 48
"""Parsing a plan, timeline, profile or safetensors header takes at most this many times the
file's size in memory, or the file is refused before parsing (``memory_bound``). Measured here
(Python 3.12, tracemalloc peak / file size): plans mpipar writes 4.4-4.8x, a checkpoint's
metadata 7.4x, a safetensors header of 100k entries 12x; the worst hostile layouts (``[[],[],...]``,
``[{},{},...]``) 44-47x, which is what the bound admits."""
_CONTAINER_BYTES = 200
_SCALAR_BYTES_PER_BYTE = 24
MAX_JSON_DEPTH = 64
"""Deeper nesting is refused: no format of ours nests past a dozen levels."""
MAX_INT_DIGITS = 30
"""Integers with more digits are refused (2^64 has 20; a 5000-digit number is an attack)."""


def _escape_char(ch: str) -> str:
    cp = ord(ch)
    if cp < 0x100:
        return f"\\x{cp:02x}"
    if cp < 0x10000:
        return f"\\u{cp:04x}"
    return f"\\U{cp:08x}"


def printable(text: Any, *, keep_newlines: bool = False) -> str:
    """``text`` (``str()`` of it) with every character a terminal would act on escaped.

    Escaped: what ``str.isprintable`` rejects (C0/C1 controls and DEL, format characters such
    as bidi overrides, lone surrogates, unassigned and private-use code points, line and
    paragraph separators), except plain spaces, and newlines when ``keep_newlines`` (the
    caller's own line structure). Linear in the text; the common all-printable case is one
    C-level scan.
    """
    s = text if isinstance(text, str) else str(text)
    if s.isprintable():
        return s
    return "".join(ch if ch.isprintable() or (keep_newlines and ch == "\n") else _escape_char(ch) for ch in s)


def _show(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 80 else shown[:77] + "..."


class FileFormatError(ValueError):
    """A file (or the dict read from one) that does not follow its format.

    ``kind`` names the format ("plan", "timeline", "profile", "checkpoint"), ``field`` the path
    of the value at fault inside the document (``"<file>"`` for the file as a whole), ``source``
    the file it came from when known.
    """

    def __init__(self, kind: str, field_path: str, value: Any, problem: str, source: str | None = None) -> None:
        where = f"{kind} {source}: field" if source else f"{kind} field"
        super().__init__(f"{where} {field_path}: {_show(value)} {problem}")
        self.kind = kind
        self.field = field_path
        self.value = value
        self.problem = problem
        self.source = source


def inside(directory: str | os.PathLike[str], name: Any, *, kind: str, field_path: str) -> str:
    """The path of ``name`` inside ``directory``, refusing anything that could lead outside it.

    ``name`` must be a plain relative file name (a string, no absolute path, no ``..``, no empty
    or ``.`` component, no NUL); its resolved path (symlinks followed) must lie inside the
    resolved ``directory``.
    """
    if not isinstance(name, str):
        raise FileFormatError(kind, field_path, name, "is not a file name (a string)", os.fspath(directory))
    parts = name.replace("\\", "/").split("/")
    if (
        not name
        or "\x00" in name
        or os.path.isabs(name)
        or name.startswith(("/", "\\"))
        or any(p in ("", ".", "..") for p in parts)
    ):
        raise FileFormatError(
            kind, field_path, name, "is not a plain relative file name inside the directory", os.fspath(directory)
        )
    root = os.path.realpath(directory)
    path = os.path.realpath(os.path.join(root, name))
    if os.path.commonpath([root, path]) != root or path == root:
        raise FileFormatError(
            kind, field_path, name, f"leads outside the directory {root} (to {path})", os.fspath(directory)
        )
    return path


def open_regular(path: str | os.PathLike[str], *, kind: str, field_path: str = "<file>") -> IO[bytes]:
    """Open ``path`` for reading only if it is a regular file.

    The file is opened non-blocking (a FIFO opens at once instead of waiting for a writer) and
    checked with ``fstat`` on the open descriptor, so nothing can swap it between check and use.
    """
    name = os.fspath(path)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(name, flags)
    except OSError as exc:
        raise FileFormatError(kind, field_path, name, f"cannot be opened ({exc.strerror or exc})", name) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            what = (
                "a directory"
                if stat.S_ISDIR(mode)
                else "a FIFO"
                if stat.S_ISFIFO(mode)
                else "a device"
                if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                else "a socket"
                if stat.S_ISSOCK(mode)
                else "not a regular file"
            )
            raise FileFormatError(kind, field_path, name, f"is {what}, not a regular file", name)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bounded(path: str | os.PathLike[str], *, kind: str, max_bytes: int = MAX_JSON_BYTES) -> bytes:
    """The bytes of the regular file ``path``, refusing one over ``max_bytes``."""
    name = os.fspath(path)
    with open_regular(name, kind=kind) as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise FileFormatError(kind, "<file>", name, f"is {size} bytes, over the limit of {max_bytes} bytes", name)
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise FileFormatError(kind, "<file>", name, f"is over the limit of {max_bytes} bytes", name)
    return data


def _int_parser(max_digits: int) -> Any:
    def parse(text: str) -> int:
        digits = len(text.lstrip("-"))
        if digits > max_digits:
            raise _NumberRefused(text, f"is an integer of {digits} digits (at most {max_digits} are read)")
        return int(text)

    return parse


def _parse_float(text: str) -> float:
    if len(text) > 400:
        raise _NumberRefused(text, f"is a number written with {len(text)} characters")
    value = float(text)
    if not math.isfinite(value):
        raise _NumberRefused(text, "overflows to infinity")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's pairs as a dict, refusing a repeated key (JSON leaves it undefined which wins;
    Python keeps the last, another reader the first: the same file would mean two things)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _NumberRefused(key, "is a key repeated in one JSON object")
            seen.add(key)
    return out


def _parse_constant(text: str) -> float:
    raise _NumberRefused(text, "is not a finite number (NaN and Infinity are refused)")


class _NumberRefused(ValueError):
    def __init__(self, text: str, problem: str) -> None:
        super().__init__(problem)
        self.text = text
        self.problem = problem


def memory_bound(data: bytes | bytearray | str) -> int:
    """An upper bound on the memory ``json.loads`` takes for ``data``, in linear time.

    Every ``[`` or ``{`` may open a container (at most ~200 bytes each in CPython, a one-key dict
    with its pair list being the largest), and every other byte makes at most ~24 bytes of
    scalars (a two-character string is 59 bytes for 5 bytes of JSON). Counting brackets inside
    strings too only overestimates."""
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    containers = raw.count(b"[") + raw.count(b"{")
    return _CONTAINER_BYTES * containers + _SCALAR_BYTES_PER_BYTE * len(raw)


def depth(value: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """Nesting depth of a JSON value (lists and objects), computed without recursion.

    Stops counting once ``limit`` is exceeded (returns ``limit + 1``).
    """
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, level)
        if deepest > limit:
            return deepest
        stack.extend((c, level + 1) for c in children if isinstance(c, dict | list))
    return deepest


def parse_json(
    data: bytes | bytearray | str,
    *,
    kind: str,
    source: str | None = None,
    max_bytes: int = MAX_JSON_BYTES,
    max_depth: int = MAX_JSON_DEPTH,
    max_int_digits: int = MAX_INT_DIGITS,
    memory_factor: int | None = None,
) -> Any:
    """Decode untrusted JSON: UTF-8, at most ``max_bytes``, ``max_depth`` levels, bounded finite numbers.

    With ``memory_factor`` (plans, timelines, profiles, safetensors headers: ``MEMORY_FACTOR``)
    a file whose ``memory_bound`` exceeds that many times its size is refused before parsing.

    ``max_int_digits`` is raised by formats that store wider integers (a checkpoint's RNG state
    holds 128-bit ones, 39 digits)."""
    if len(data) > max_bytes:
        raise FileFormatError(kind, "<file>", source, f"is {len(data)} bytes, over the limit of {max_bytes}", source)
    if memory_factor is not None and len(data):
        bound = memory_bound(data)
        if bound > memory_factor * len(data):
            raise FileFormatError(
                kind,
                "<file>",
                source,
                f"is {len(data)} bytes with {bound // len(data)}x its size in brackets and values: parsing it "
                f"could take more than {memory_factor}x its size in memory, which no file of this kind needs",
                source,
            )
    if isinstance(data, bytes | bytearray):
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise FileFormatError(
                kind, "<file>", data[exc.start : exc.start + 1], f"at byte {exc.start} is not UTF-8 text", source
            ) from None
    else:
        text = data
    if text.startswith("\ufeff"):
        text = text[1:]
    try:
        value = json.loads(
            text,
            parse_int=_int_parser(max_int_digits),
            parse_float=_parse_float,
            parse_constant=_parse_constant,
            object_pairs_hook=_unique_keys,
        )
    except _NumberRefused as exc:
        where = "<key>" if exc.problem.startswith("is a key") else "<number>"
        raise FileFormatError(kind, where, exc.text, exc.problem, source) from None
    except json.JSONDecodeError as exc:
        raise FileFormatError(
            kind,
            "<file>",
            source,
            f"is not valid JSON (line {exc.lineno} column {exc.colno}: {exc.msg}); is the file truncated?",
            source,
        ) from None
    except RecursionError:
        raise FileFormatError(kind, "<file>", source, f"nests JSON more than {max_depth} levels deep", source) from None
    except ValueError as exc:
        raise FileFormatError(kind, "<file>", source, f"cannot be read as JSON ({exc})", source) from None
    if depth(value, max_depth) > max_depth:
        raise FileFormatError(kind, "<file>", source, f"nests JSON more than {max_depth} levels deep", source)
    return value


def load_json(
    path: str | os.PathLike[str], *, kind: str, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH
) -> Any:
    """``read_bounded`` then ``parse_json`` (memory bounded by ``MEMORY_FACTOR``): the one call for a
    plan, timeline or profile file from elsewhere."""
    name = os.fspath(path)
    return parse_json(
        read_bounded(name, kind=kind, max_bytes=max_bytes),
        kind=kind,
        source=name,
        max_bytes=max_bytes,
        max_depth=max_depth,
        memory_factor=MEMORY_FACTOR,
    )
