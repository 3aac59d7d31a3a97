"""`Registry`: one extension point's table of name → object, whose lookups also take an import path
"package.module:attr", so that a config may name a registered entry or the user's own object; a typo is told the
nearest name."""

from __future__ import annotations

import difflib
from typing import Callable, Generic, Iterator, TypeVar

from baton.config.loader import ConfigError, import_object

T = TypeVar("T")

IMPORT_PATH_HINT = "or an import path 'package.module:attr'"


class Registry(Generic[T]):
    """Name → object (a function, a class, a spec) for one extension point: `kind` says which in messages
    ("advantage estimator").

    Entries are added with `@registry.register(name)` or `registry[name] = obj`; a name may be added once, and never
    holds ":" (that marks an import path). An entry that is a string is an import path itself, imported on first
    `get`: a registry names a heavy module's object without importing it. `get(name_or_path)` returns a registered
    entry or the object an import path names; anything else is a `ConfigError` (a ValueError) naming the registry,
    the name, the valid names, the nearest one, and the import path form."""

    def __init__(self, kind: str, entries: dict[str, T | str] | None = None):
        self.kind = kind
        self._entries: dict[str, T | str] = {}
        for name, obj in (entries or {}).items():
            self[name] = obj

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: add the decorated object under `name`."""
        def decorator(obj: T) -> T:
            self[name] = obj
            return obj
        return decorator

    def __setitem__(self, name: str, obj: T | str) -> None:
        name = str(name)  # a StrEnum member as its plain value
        if ":" in name:
            raise ValueError(f"{self.kind} name {name!r} holds ':', which marks an import path; pick a plain name")
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered; pick another name")
        self._entries[name] = obj

    def get(self, name: str, *, key: str | None = None) -> T:
        """The entry registered as `name`, or the object the import path `name` names. key: the config key that gave
        `name`, to start the message with (`algorithm.adv_estimator 'grop' is not one of [...]`)."""
        if name in self._entries:
            entry = self._entries[name]
            return self._import(entry, name, key) if isinstance(entry, str) else entry
        if ":" in name:
            return self._import(name, name, key)
        close = difflib.get_close_matches(name, self.names(), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        head = f"{key} {name!r} is not one of" if key else f"unknown {self.kind} {name!r}; valid:"
        raise ConfigError(f"{head} {self.names()} {IMPORT_PATH_HINT}{hint}")

    def _import(self, path: str, name: str, key: str | None) -> T:
        try:
            return import_object(path)
        except ConfigError as e:
            reason = str(e).removeprefix(f"import path {path!r}: ")
            where = f"{key}: " if key else ""
            raise ConfigError(f"{where}{self.kind} {name!r} cannot be imported: {reason} (modules are found beside "
                              "the config file, in the working directory and on PYTHONPATH)") from e

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._entries)

    def pop(self, name: str) -> T | str:
        """Remove the entry `name` (a test's own registration, say) and return it as registered."""
        return self._entries.pop(name)

    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"


def check_call(obj: Callable, key: str, contract: str, *args, **kwargs) -> None:
    """Raise ConfigError unless `obj` can be called with `args` and `kwargs` (placeholders standing for what it will
    get), read from its signature, never by calling it; `contract` is how it is called, for the message
    ("fn(args, sample) -> float | dict"). An object without a signature to read is left to its call."""
    import inspect

    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # some builtins and C extensions have none
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as e:
        name = getattr(obj, "__qualname__", repr(obj))
        raise ConfigError(f"{key}: {name}{signature} cannot be called as {contract}: {str(e).rstrip('.')}; give it "
                          "that signature") from None
