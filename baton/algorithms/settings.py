"""The typed settings of an algorithm component (a policy loss, a rollout correction): a frozen dataclass per
component, declared where the component registers itself, whose fields are the keyword arguments it is called with."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class NoSettings:
    """The settings of a component that takes none: the default for a function registered without a config class,
    or given by an import path that names a plain function."""


def setting_names(config: type) -> tuple[str, ...]:
    """The settings a config class declares: its fields, in order."""
    return tuple(f.name for f in dataclasses.fields(config))


def as_kwargs(settings: Any) -> dict[str, Any]:
    """A config instance's fields as the keyword arguments its component is called with."""
    return {name: getattr(settings, name) for name in setting_names(type(settings))}
