"""Schema checking for message bodies: frozen dataclasses validated field by field.

Why not a generic JSON-schema library: our bodies are small and typed, and a tiny checker that
knows only ``str``, ``int``, ``float``, ``bool``, tuples, string-keyed dicts, ``X | None`` and
nested dataclasses gives exact errors and no way to smuggle objects in.

Unknown fields are refused, except in a type that declares ``EXTENSIBLE = True`` (a heartbeat and
its capabilities): there a newer sender's added fields are skipped, at most
:data:`MAX_UNKNOWN_FIELDS` of them, each named like a field (:data:`FIELD_NAME`), so the next field
added to a heartbeat does not make older nodes drop every heartbeat of newer ones (the
``reachability`` field did: older nodes refused them as ``schema``, and the mesh split by version).
The rule for adding a field (docs/mesh.md): to an extensible type, only an optional one (with a
default) whose absence means what older nodes do, since they never see it; to any other type
(plans, records, votes: messages an older node would act on without the field, or whose signed
bytes are checked again outside pubsub), never: that is a new type or a new wire version. The one
exception is a field marked ``ABSENT`` (``metadata={"absent": True}``, default None) that only some
runs use (a plan's ``stages``, for a pipelined task, which no older node can parse and so never
joins): it is left out of the plain form when None and refused as an explicit null, so every other
message keeps its bytes and there is one encoding of each; an older node refuses a message that has
it, which is right, as it could not act on it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
import typing
from typing import Any, TypeVar

from p2ptrain.wire._limits import MAX_DICT_LEN, MAX_LIST_LEN, MAX_STR_LEN


# Unknown fields an EXTENSIBLE type skips per object: a newer minor version adds a field or two at a
# time; more is not a newer version of this type but something else. Their values are bounded like
# every body's (the 64 KiB message cap, nesting depth 32) and are never read.
MAX_UNKNOWN_FIELDS = 8
# What a skipped field's name must look like: one of ours (lower-case Python identifiers, short).
FIELD_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")

# Integers are signed 64-bit, like every number boundedjson lets through.
_MIN_INT, _MAX_INT = -(2**63), 2**63 - 1


class SchemaError(ValueError):
    """A body does not match its message's schema."""


T = TypeVar("T")


def _check(value: Any, tp: Any, where: str, meta: dict[str, Any]) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _check(value, inner, where, meta)
    if tp is str:
        if type(value) is not str:
            raise SchemaError(f"{where}: expected a string")
        if len(value) > meta.get("max_len", MAX_STR_LEN):
            raise SchemaError(f"{where}: string longer than {meta.get('max_len', MAX_STR_LEN)}")
        # A field shown as it is (logged, printed by the CLI): no newline or terminal escape, which
        # would let a peer forge log lines or rewrite the reader's terminal.
        if meta.get("printable") and not value.isprintable():
            raise SchemaError(f"{where}: string with characters that are not printable")
        return value
    if tp is bool:
        if type(value) is not bool:
            raise SchemaError(f"{where}: expected true/false")
        return value
    if tp is int:
        if type(value) is not int:
            raise SchemaError(f"{where}: expected an integer")
        if not _MIN_INT <= value <= _MAX_INT:
            raise SchemaError(f"{where}: integer out of range")
        return value
    if tp is float:
        # An int is range-checked *before* any float arithmetic: ``math.isfinite(10**400)`` and
        # ``float(10**400)`` raise OverflowError, which is not this checker's declared error.
        if type(value) is int and _MIN_INT <= value <= _MAX_INT:
            return float(value)
        if type(value) is float and math.isfinite(value):
            return value
        raise SchemaError(f"{where}: expected a finite number in range")
    if origin is tuple:
        inner, ellipsis = typing.get_args(tp)
        assert ellipsis is Ellipsis, "only tuple[T, ...] is supported"
        if type(value) is not list:
            raise SchemaError(f"{where}: expected a list")
        if len(value) > meta.get("max_items", MAX_LIST_LEN):
            raise SchemaError(f"{where}: more than {meta.get('max_items', MAX_LIST_LEN)} items")
        # A tuple field's "max_len" bounds each of its strings (e.g. a heartbeat's addresses).
        item_meta = {k: v for k, v in meta.items() if k != "max_items"}
        if inner is str:  # member lists, addresses: checked in one pass, each item named only if wrong
            limit = item_meta.get("max_len", MAX_STR_LEN)
            for i, v in enumerate(value):
                if type(v) is not str or len(v) > limit:
                    _check(v, str, f"{where}[{i}]", item_meta)  # raises, naming the item
            return tuple(value)
        return tuple(_check(v, inner, f"{where}[{i}]", item_meta) for i, v in enumerate(value))
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        assert key_tp is str, "only string-keyed dicts are supported"
        if type(value) is not dict:
            raise SchemaError(f"{where}: expected an object")
        if len(value) > meta.get("max_items", MAX_DICT_LEN):
            raise SchemaError(f"{where}: more than {meta.get('max_items', MAX_DICT_LEN)} keys")
        return {
            _check(k, str, f"{where} key", {}): _check(v, val_tp, f"{where}.{k}", {})
            for k, v in value.items()
        }
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return from_plain(tp, value, where)
    raise TypeError(f"unsupported schema type {tp!r} at {where}")


@functools.cache
def _layout(cls: type) -> tuple[dict[str, Any], dict[str, dataclasses.Field[Any]]]:
    """The resolved field types and the fields of a schema class, once per class: resolving the
    (string) annotations took 160 of the 200 µs of building a RoundPlan, and every node decodes
    every message of the mesh."""
    return typing.get_type_hints(cls), {f.name: f for f in dataclasses.fields(cls)}


def from_plain(cls: type[T], data: Any, where: str = "body") -> T:
    """Build dataclass ``cls`` from decoded JSON ``data``, rejecting missing or mistyped fields and
    unknown ones (an ``EXTENSIBLE`` type skips up to :data:`MAX_UNKNOWN_FIELDS` well-named ones)."""
    if type(data) is not dict:
        raise SchemaError(f"{where}: expected an object")
    hints, fields = _layout(cls)  # type: ignore[arg-type]  # a class is hashable
    unknown = set(data) - set(fields)
    if unknown:
        if not getattr(cls, "EXTENSIBLE", False):
            raise SchemaError(f"{where}: unknown field(s) {sorted(unknown)[:8]}")
        if len(unknown) > MAX_UNKNOWN_FIELDS:
            raise SchemaError(f"{where}: {len(unknown)} unknown fields, over {MAX_UNKNOWN_FIELDS}")
        badly_named = sorted(name for name in unknown if not FIELD_NAME.fullmatch(name))
        if badly_named:
            raise SchemaError(f"{where}: unknown field(s) not named like a field {[n[:32] for n in badly_named[:4]]}")
    kwargs = {}
    for name, f in fields.items():
        if name not in data:
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
                continue
            raise SchemaError(f"{where}: missing field {name!r}")
        if data[name] is None and f.metadata.get("absent"):
            raise SchemaError(f"{where}.{name}: null (leave the field out)")
        kwargs[name] = _check(data[name], hints[name], f"{where}.{name}", dict(f.metadata))
    return cls(**kwargs)


def to_plain(obj: Any) -> Any:
    """The JSON-ready form of a schema dataclass (tuples become lists)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {
            f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)
            if not (f.metadata.get("absent") and getattr(obj, f.name) is None)
        }
    if isinstance(obj, (tuple, list)):
        return [to_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    return obj
