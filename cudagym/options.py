"""Command-line options read from the config models.

A setting's default and meaning are written once, on its model's field (`Field(default=...,
description=...)`); `option` makes the typer option from that field, so every command that
offers the setting (`cudagym run`, `cudagym check`, `cudagym sandbox image build`) shows the
same help and default, and validation stays the model's.
"""

from __future__ import annotations

import typing
from typing import Any

import typer
from pydantic import BaseModel

_UNSET: Any = object()


def field_default(model: type[BaseModel], name: str) -> Any:
    """The default of `model`'s field `name` (its factory's product; a backend config: its name)."""
    value = model.model_fields[name].get_default(call_default_factory=True)
    return getattr(value, "backend", value) if isinstance(value, BaseModel) else value


def choices(model: type[BaseModel], name: str) -> tuple[str, ...]:
    """The values a `Literal` field takes (a union of backend configs: their names)."""
    annotation = model.model_fields[name].annotation
    if typing.get_origin(annotation) is typing.Literal:
        return typing.get_args(annotation)
    names: list[str] = []
    for arm in typing.get_args(annotation):
        backend = getattr(arm, "model_fields", {}).get("backend")
        if backend is not None:
            names.extend(typing.get_args(backend.annotation))
    return tuple(names)


def option(model: type[BaseModel], name: str, *flags: str, default: Any = _UNSET, **kw: Any) -> Any:
    """A typer option for `model`'s field `name`: its help text is the field's description, its
    default the field's (or `default`, where the command line spells the value differently, e.g.
    "LOW,HIGH" for a pair), and an integer field's lower bound its `min`."""
    field = model.model_fields[name]
    if field.description is None:
        raise TypeError(f"{model.__name__}.{name} has no description to show as its option's help")
    for bound in field.metadata:  # `Field(ge=...)` is an `annotated_types.Ge` here
        if getattr(bound, "ge", None) is not None and "min" not in kw:
            kw["min"] = bound.ge
    return typer.Option(field_default(model, name) if default is _UNSET else default, *flags,
                        help=field.description, **kw)
