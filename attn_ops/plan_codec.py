"""Typed plan vectors: one codec between a frozen dataclass and a small CPU int64 tensor.

Host plans travel into ops as tensors (a Python object cannot be an op argument, and a tensor
of fixed length gives Dynamo no size or value to specialize on). :class:`PlanCodec` is the only
place that knows the positions: ops decode by field name, builders encode dataclasses. Fields
may be ``int``, ``bool``, an ``enum.Enum``, a ``NamedTuple`` of ints and bools (a tile),
``X | None`` of those, or -- the last field only -- ``tuple[int, ...]`` (a variable-length
tail, such as a library's own plan).

Example::

    @dataclass(frozen=True)
    class Bounds:
        max_query: int
        num_tokens: int | None   # None: known on the device only (CUDA graphs)

    BOUNDS = PlanCodec(Bounds)
    t = BOUNDS.encode(Bounds(7, None))      # tensor([7, 0, 0])
    assert BOUNDS.decode(t) == Bounds(7, None)
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from typing import Generic, TypeVar

import torch

__all__ = ["PlanCodec"]

T = TypeVar("T")

_INT, _BOOL, _ENUM, _TUPLE, _TAIL = "int", "bool", "enum", "namedtuple", "tail"


class PlanCodec(Generic[T]):
    """Encodes ``cls`` instances as int64 CPU tensors of ``length`` entries (the fixed part's
    width when ``length`` is None) and decodes them back. An optional field takes two entries
    (present, value); a tail field its length and its values, zero-padded to ``length``."""

    def __init__(self, cls: type[T], length: int | None = None) -> None:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls.__name__} is not a dataclass")
        hints = typing.get_type_hints(cls)
        self.cls = cls
        self._fields: list[tuple[str, str, bool, type | None]] = []
        self._tuple_kinds: dict[str, list[type]] = {}
        width = 0
        names = [f.name for f in dataclasses.fields(cls)]
        for i, name in enumerate(names):
            kind, optional, enum_cls = _kind(hints[name], f"{cls.__name__}.{name}")
            if kind == _TAIL and i != len(names) - 1:
                raise TypeError(f"{cls.__name__}.{name}: a tuple[int, ...] field must be last")
            self._fields.append((name, kind, optional, enum_cls))
            if kind == _TUPLE:
                inner = typing.get_type_hints(enum_cls)
                self._tuple_kinds[name] = [inner[n] for n in enum_cls._fields]
            width += (len(enum_cls._fields) if kind == _TUPLE else 1) + optional
        self.fixed_width = width
        self.has_tail = bool(self._fields) and self._fields[-1][1] == _TAIL
        self.length = length if length is not None else width
        if self.length < width:
            raise ValueError(f"length={length} is below {cls.__name__}'s {width} fixed entries")
        if not self.has_tail and self.length != width:
            raise ValueError(f"{cls.__name__} has no tail field: length must be {width}")

    @property
    def max_tail(self) -> int:
        """The most values a tail field can hold."""
        return self.length - self.fixed_width if self.has_tail else 0

    def encode(self, value: T) -> torch.Tensor:
        if not isinstance(value, self.cls):
            raise TypeError(f"expected {self.cls.__name__}, got {type(value).__name__}")
        entries: list[int] = []
        for name, kind, optional, enum_cls in self._fields:
            v = getattr(value, name)
            if kind == _TAIL:
                if len(v) > self.max_tail:
                    raise ValueError(f"{self.cls.__name__}.{name} has {len(v)} values; this "
                                     f"codec holds {self.max_tail} (raise its length)")
                entries.append(len(v))
                entries.extend(int(x) for x in v)
                continue
            if optional:
                entries.append(0 if v is None else 1)
                if v is None:
                    entries.extend([0] * (len(enum_cls._fields) if kind == _TUPLE else 1))
                    continue
            if kind == _TUPLE:
                entries.extend(int(x) for x in v)
            elif kind == _ENUM:
                entries.append(list(enum_cls).index(v))
            else:
                entries.append(int(v))
        entries.extend([0] * (self.length - len(entries)))
        return torch.tensor(entries, dtype=torch.int64)

    def decode(self, tensor: torch.Tensor | list[int]) -> T:
        entries = tensor.tolist() if isinstance(tensor, torch.Tensor) else tensor
        if len(entries) != self.length:
            raise ValueError(f"a {self.cls.__name__} plan has {self.length} entries, got "
                             f"{len(entries)}")
        values, at = {}, 0
        for name, kind, optional, enum_cls in self._fields:
            if kind == _TAIL:
                n = entries[at]
                values[name] = tuple(entries[at + 1:at + 1 + n])
                break
            width = len(enum_cls._fields) if kind == _TUPLE else 1
            if optional:
                present, at = entries[at], at + 1
                if not present:
                    values[name], at = None, at + width
                    continue
            if kind == _TUPLE:
                raw = entries[at:at + width]
                values[name] = enum_cls(*(bool(x) if k is bool else x
                                          for k, x in zip(self._tuple_kinds[name], raw)))
                at += width
                continue
            raw, at = entries[at], at + 1
            values[name] = (list(enum_cls)[raw] if kind == _ENUM
                            else bool(raw) if kind == _BOOL else raw)
        return self.cls(**values)


def _kind(hint, where: str) -> tuple[str, bool, type | None]:
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) != 1 or len(typing.get_args(hint)) != 2:
            raise TypeError(f"{where}: only X | None unions are supported, got {hint}")
        hint, optional = args[0], True
    if hint is bool:
        return _BOOL, optional, None
    if hint is int:
        return _INT, optional, None
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _ENUM, optional, hint
    if isinstance(hint, type) and issubclass(hint, tuple) and hasattr(hint, "_fields"):
        inner = typing.get_type_hints(hint)
        if any(inner[n] not in (int, bool) for n in hint._fields):
            raise TypeError(f"{where}: {hint.__name__}'s fields must be int or bool")
        return _TUPLE, optional, hint
    if typing.get_origin(hint) is tuple and typing.get_args(hint) == (int, Ellipsis):
        if optional:
            raise TypeError(f"{where}: a tail field cannot be optional")
        return _TAIL, False, None
    raise TypeError(f"{where}: {hint} is not int, bool, an Enum, a NamedTuple of ints, X | None "
                    "or tuple[int, ...]")
