"""Names of another framework's API that mpipar does not have: importable, refused when used.

    CompiledProgram = unsupported("paddle.static.CompiledProgram", "run the Program itself")

A script moved from Paddle imports and runs up to the first such call, which stops with a
``NotImplementedError`` naming the call and what to do instead: the script's author sees the
first thing to change, not an ``AttributeError`` deep inside an import.
"""

from __future__ import annotations

from typing import Any, NoReturn


class Unsupported:
    """A stand-in for an unsupported callable or class: any call (or attribute) refuses."""

    def __init__(self, qualname: str, hint: str) -> None:
        self._qualname, self._hint = qualname, hint

    def _refuse(self) -> NoReturn:
        raise NotImplementedError(f"{self._qualname} is not supported by mpipar: {self._hint}")

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._refuse()

    def __getattr__(self, name: str) -> NoReturn:
        if name.startswith("__"):
            raise AttributeError(name)
        raise NotImplementedError(f"{self._qualname}.{name} is not supported by mpipar: {self._hint}")

    def __enter__(self) -> NoReturn:
        self._refuse()

    def __exit__(self, *exc: object) -> None:
        return None

    def __repr__(self) -> str:
        return f"<unsupported {self._qualname}>"


def unsupported(qualname: str, hint: str) -> Unsupported:
    return Unsupported(qualname, hint)
