"""The few pieces of pydantic (and annotated_types) that config.py uses, for where pydantic is
absent: the GPU device image (Python 3.12, torch, Triton, transformers; no vLLM, no pydantic,
nothing fetched there), on which lab/gpu_check.sh builds the learner and its loss.

config.py imports pydantic when it can and this module only when it cannot, so every install
(pydantic is a vLLM dependency) keeps pydantic's full validation. Here: defaults and
`default_factory`, nested sections from dicts, unknown keys refused, `Literal` members, numeric
ranges (gt/ge/lt/le, also inside `Annotated[...]` of list/tuple items), `min_length`, optional
fields, before/after model validators and after field validators, frozen instances,
`model_copy` / `model_dump` / `model_dump_json` / `model_fields`. Errors are raised as a
`ValidationError` whose `errors()` rows carry pydantic's loc/type/ctx keys, so config.py's
one-line messages read the same. Not here: pydantic's lax coercions beyond int -> float (a
string for a number is refused, not parsed).
"""

from __future__ import annotations

import json
import math
import sys
import types
import typing
from typing import Annotated, Any, Literal, Union, get_args, get_origin

_MISSING = object()
# What pydantic's lax mode reads as a boolean.
_BOOL_WORDS = {"true": True, "yes": True, "on": True, "1": True, "t": True, "y": True,
               "false": False, "no": False, "off": False, "0": False, "f": False, "n": False}


# -- annotated_types ------------------------------------------------------------------------------

class _Bound:
    key = ""

    def __init__(self, value: Any) -> None:
        setattr(self, self.key, value)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.key}={getattr(self, self.key)!r})"


class Gt(_Bound):
    key = "gt"


class Ge(_Bound):
    key = "ge"


class Lt(_Bound):
    key = "lt"


class Le(_Bound):
    key = "le"


at = types.SimpleNamespace(Gt=Gt, Ge=Ge, Lt=Lt, Le=Le)


# -- Field, ConfigDict, ValidationError, validators -----------------------------------------------

class FieldInfo:
    def __init__(self, default: Any = _MISSING, *, default_factory: Any = None,
                 description: str | None = None, min_length: int | None = None,
                 gt: Any = None, ge: Any = None, lt: Any = None, le: Any = None, **_: Any) -> None:
        self.default = default
        self.default_factory = default_factory
        self.description = description
        self.min_length = min_length
        self.metadata = [cls(v) for cls, v in ((Gt, gt), (Ge, ge), (Lt, lt), (Le, le))
                         if v is not None]
        self.annotation: Any = None

    def is_required(self) -> bool:
        return self.default is _MISSING and self.default_factory is None

    def get_default(self, call_default_factory: bool = True) -> Any:
        if self.default_factory is not None:
            return self.default_factory() if call_default_factory else self.default_factory
        return None if self.default is _MISSING else self.default


def Field(default: Any = _MISSING, **kw: Any) -> Any:  # noqa: N802 - pydantic's name
    return FieldInfo(default, **kw)


def ConfigDict(**kw: Any) -> dict:  # noqa: N802 - pydantic's name
    return dict(kw)


class ValidationError(ValueError):
    def __init__(self, title: str, errors: list[dict]) -> None:
        self.title = title
        self._errors = errors
        super().__init__(f"{len(errors)} validation error(s) for {title}: "
                         + "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors))

    def errors(self, include_url: bool = True) -> list[dict]:
        return [dict(e) for e in self._errors]

    def error_count(self) -> int:
        return len(self._errors)


def field_validator(*fields: str, mode: str = "after") -> Any:
    def mark(fn: Any) -> Any:
        target = fn.__func__ if isinstance(fn, classmethod) else fn
        target._lite_field_validator = (fields, mode)
        return fn
    return mark


def model_validator(*, mode: str) -> Any:
    def mark(fn: Any) -> Any:
        target = fn.__func__ if isinstance(fn, classmethod) else fn
        target._lite_model_validator = mode
        return fn
    return mark


# -- the model ------------------------------------------------------------------------------------

class _Invalid(Exception):
    def __init__(self, errors: list[dict]) -> None:
        self.errors = errors


def _err(loc: tuple, kind: str, msg: str, value: Any, **ctx: Any) -> dict:
    return {"type": kind, "loc": loc, "msg": msg, "input": value, **({"ctx": ctx} if ctx else {})}


class _ModelMeta(type):
    @property
    def model_fields(cls) -> dict[str, FieldInfo]:
        """Fields of the class and its bases, their annotations resolved (on first use: the
        module's later names exist by then)."""
        cached = cls.__dict__.get("_lite_fields")
        if cached is not None:
            return cached
        hints = typing.get_type_hints(cls, globalns=vars(sys.modules[cls.__module__]),
                                      include_extras=True)
        fields: dict[str, FieldInfo] = {}
        for klass in reversed(cls.__mro__):
            for name in klass.__dict__.get("__annotations__", {}):
                if name.startswith("_") or name == "model_config" or name not in hints:
                    continue
                if get_origin(hints[name]) is typing.ClassVar:
                    continue
                raw = klass.__dict__.get(name, _MISSING)
                info = raw if isinstance(raw, FieldInfo) else FieldInfo(raw)
                info.annotation = hints[name]
                fields[name] = info
        cls._lite_fields = fields
        return fields


class BaseModel(metaclass=_ModelMeta):
    model_config: dict = {}

    def __init__(self, **data: Any) -> None:
        built = type(self).model_validate(data)
        object.__setattr__(self, "__dict__", built.__dict__)

    # -- pydantic's API, the part config.py uses ---------------------------------------------------
    @classmethod
    def model_validate(cls, data: Any) -> Any:
        try:
            return cls._build(data, ())
        except _Invalid as e:
            raise ValidationError(cls.__name__, e.errors) from None

    def model_dump(self, *, mode: str = "python") -> dict:
        out = {k: _dump(getattr(self, k)) for k in type(self).model_fields}
        return json.loads(json.dumps(out)) if mode == "json" else out

    def model_dump_json(self) -> str:
        return json.dumps(self.model_dump(), separators=(",", ":"))

    def model_copy(self, *, update: dict | None = None, deep: bool = False) -> Any:
        new = object.__new__(type(self))
        object.__setattr__(new, "__dict__", {**self.__dict__, **(update or {})})
        return new

    def __setattr__(self, name: str, value: Any) -> None:
        if type(self).model_config.get("frozen"):
            raise TypeError(f"{type(self).__name__} is frozen: cannot set {name!r}")
        object.__setattr__(self, name, value)

    def __eq__(self, other: Any) -> bool:
        return type(other) is type(self) and self.model_dump() == other.model_dump()

    def __hash__(self) -> int:
        return hash(json.dumps(self.model_dump(), sort_keys=True, default=str))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.__dict__.items())})"

    # -- building ----------------------------------------------------------------------------------
    @classmethod
    def _validators(cls, kind: str) -> list[tuple[Any, Any]]:
        out = []
        for klass in reversed(cls.__mro__):
            for attr in klass.__dict__.values():
                fn = attr.__func__ if isinstance(attr, (classmethod, staticmethod)) else attr
                mark = getattr(fn, "_lite_" + kind, None)
                if mark is not None:
                    out.append((mark, attr))
        return out

    @classmethod
    def _build(cls, data: Any, loc: tuple) -> Any:
        if isinstance(data, cls):
            return data
        for mode, attr in cls._validators("model_validator"):
            if mode == "before":
                data = attr.__get__(None, cls)(data)
        if not isinstance(data, dict):
            raise _Invalid([_err(loc, "model_type", f"Input should be a valid dictionary or "
                                 f"instance of {cls.__name__}", data,
                                 class_name=cls.__name__)])
        fields, errors, values = cls.model_fields, [], {}
        if cls.model_config.get("extra") == "forbid":
            errors += [_err(loc + (k,), "extra_forbidden", "Extra inputs are not permitted", v)
                       for k, v in data.items() if k not in fields]
        field_validators = cls._validators("field_validator")
        for name, info in fields.items():
            if name in data:
                try:
                    value = _check(data[name], info.annotation, loc + (name,))
                    value = _constrain(value, info, loc + (name,), data[name])
                    for (names, _mode), attr in field_validators:
                        if name in names:
                            value = attr.__get__(None, cls)(value)
                except _Invalid as e:
                    errors += e.errors
                    continue
                except ValueError as e:
                    errors.append(_err(loc + (name,), "value_error", f"Value error, {e}",
                                       data[name], error=e))
                    continue
            elif info.is_required():
                errors.append(_err(loc + (name,), "missing", "Field required", data))
                continue
            else:
                value = info.get_default()
            values[name] = value
        if errors:
            raise _Invalid(errors)
        obj = object.__new__(cls)
        object.__setattr__(obj, "__dict__", values)
        for mode, attr in cls._validators("model_validator"):
            if mode == "after":
                try:
                    obj = attr.__get__(obj, cls)()
                except ValueError as e:
                    raise _Invalid([_err(loc, "value_error", f"Value error, {e}", data,
                                         error=e)]) from None
        return obj


def _dump(v: Any) -> Any:
    if isinstance(v, BaseModel):
        return v.model_dump()
    if isinstance(v, list):
        return [_dump(x) for x in v]
    if isinstance(v, tuple):
        return tuple(_dump(x) for x in v)
    return v


def _constrain(value: Any, info: Any, loc: tuple, raw: Any = _MISSING) -> Any:
    """A FieldInfo's (or Annotated metadata's) ranges and min_length; errors show `raw`, the
    value as given (before int -> float)."""
    shown = value if raw is _MISSING else raw
    for m in getattr(info, "metadata", ()):
        if isinstance(m, FieldInfo):
            value = _constrain(value, m, loc, shown)
            continue
        if value is None or not isinstance(value, (int, float)):
            continue
        for cls, kind, op, ok in ((Gt, "greater_than", ">", lambda v, b: v > b),
                                  (Ge, "greater_than_equal", ">=", lambda v, b: v >= b),
                                  (Lt, "less_than", "<", lambda v, b: v < b),
                                  (Le, "less_than_equal", "<=", lambda v, b: v <= b)):
            if isinstance(m, cls) and not ok(value, getattr(m, cls.key)):
                bound = getattr(m, cls.key)
                raise _Invalid([_err(loc, kind, f"Input should be {op} {bound}", shown,
                                     **{cls.key: bound})])
    n = getattr(info, "min_length", None)
    if n is not None and value is not None and len(value) < n:
        raise _Invalid([_err(loc, "too_short", f"Value should have at least {n} items", value,
                             min_length=n)])
    return value


def _check(value: Any, tp: Any, loc: tuple) -> Any:
    """`value` as type `tp` (pydantic's strict-ish reading), or _Invalid."""
    origin = get_origin(tp)
    if origin is Annotated:
        base, *meta = get_args(tp)
        holder = types.SimpleNamespace(metadata=meta)
        return _constrain(_check(value, base, loc), holder, loc, value)
    if tp is Any:
        return value
    if origin is Literal:
        allowed = get_args(tp)
        if value in allowed and not (isinstance(value, bool) and True not in allowed
                                     and False not in allowed):
            return value
        names = [repr(a) for a in allowed]
        expected = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
        raise _Invalid([_err(loc, "literal_error", f"Input should be {expected}", value,
                             expected=expected)])
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors: list[dict] = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check(value, arg, loc)
            except _Invalid as e:
                errors += e.errors
        raise _Invalid(errors or [_err(loc, "union_tag_invalid", "Input is invalid", value)])
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp._build(value, loc)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise _Invalid([_err(loc, f"{origin.__name__}_type",
                                 f"Input should be a valid {origin.__name__}", value)])
        args = get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise _Invalid([_err(loc, "too_long" if len(value) > len(args) else "too_short",
                                     f"Tuple should have {len(args)} items", value)])
            return tuple(_check(v, a, loc + (i,)) for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        out = [_check(v, item, loc + (i,)) for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.strip().lower() in _BOOL_WORDS:
            return _BOOL_WORDS[value.strip().lower()]
        raise _Invalid([_err(loc, "bool_type", "Input should be a valid boolean", value)])
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise _Invalid([_err(loc, "int_type", "Input should be a valid integer", value)])
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise _Invalid([_err(loc, "finite_number", "Input should be a finite number",
                                     value)])
            return float(value)
        raise _Invalid([_err(loc, "float_type", "Input should be a valid number", value)])
    if tp is str:
        if isinstance(value, str):
            return value
        raise _Invalid([_err(loc, "string_type", "Input should be a valid string", value)])
    return value
