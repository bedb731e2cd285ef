"""What every spec shares: strict pydantic models, and one-line messages for bad input."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError


class ConfigError(ValueError):
    """A user's configuration is invalid. Its message is one line for the terminal."""


# The largest integer SQLite (and numpy's int64) holds: a seed or size past it cannot be stored.
MAX_INT64 = 2**63 - 1


class Spec(BaseModel):
    # allow_inf_nan=False: `lr = inf` or `nan` (TOML reads both) is refused here, not in every rank.
    model_config = ConfigDict(extra="forbid", validate_default=True, allow_inf_nan=False)


# A value longer than this is shown cut: a 100 kB string would make the one line 100 kB.
MAX_SHOWN_CHARS = 120


class _Shown:
    """A value's repr, cut to MAX_SHOWN_CHARS with its length said."""

    def __init__(self, value: Any):
        self.text = repr(value)
        if len(self.text) > MAX_SHOWN_CHARS:
            self.text = f"{self.text[:MAX_SHOWN_CHARS - 40]}... ({len(self.text):,} characters)"

    def __repr__(self) -> str:
        return self.text


def describe_validation_error(err: ValidationError, prefix: str = "") -> str:
    """Turn pydantic's first error into one line: field, value, what is allowed."""
    first = err.errors(include_url=False)[0]
    loc = ".".join(str(p) for p in (prefix, *first["loc"]) if p != "")
    value = _Shown(first.get("input"))
    if first["type"] == "missing":  # the input is the whole table: naming the field says it all
        return f"{loc}: required, missing"
    if first["type"] == "extra_forbidden":
        allowed = ", ".join(sorted(_allowed_fields(err.title, first["loc"])))
        return f"{loc} = {value!r}: unknown field; allowed: {allowed}"
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "value_error" or not first["loc"]:
        return f"{loc or prefix}: {msg}"
    return f"{loc} = {value!r}: {msg}"


_SPEC_CLASSES: dict[str, type[BaseModel]] = {}


def remember_spec_class(cls: type[BaseModel]) -> None:
    """Let error messages list the fields of a plugin's spec class."""
    _SPEC_CLASSES[cls.__name__] = cls


def _allowed_fields(title: str, loc: tuple[Any, ...]) -> list[str]:
    model: Any = _SPEC_CLASSES.get(title)
    for part in loc[:-1]:
        field = model.model_fields.get(part) if model else None
        model = getattr(field, "annotation", None) if field else None
    return list(model.model_fields) if isinstance(model, type) and issubclass(model, BaseModel) else []
