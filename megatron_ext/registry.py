"""One registry for everything the project is extended by: trainers, sub-commands, benchmarks,
optimizers.

Each kind is a :class:`Registry`. The shipped entries register in code, where the registry is
declared (``shipped``: name -> ``"module:attribute"``, e.g. ``"muon":
"megatron_ext.optimizers.muon_spec:SPEC"``), so a source checkout sees a new one without a
reinstall; other distributions add theirs through one ``importlib.metadata`` entry-point group
per kind, in their own metadata::

    entry_points={
        "megatron_ext.trainers": ["countdown = mx_plugin.countdown:TRAINER"],
        "megatron_ext.optimizers": ["sign_descent = mx_plugin.spec:SPEC"],
        "megatron_ext.commands": ["mine = mx_plugin.cli:COMMAND"],
        "megatron_ext.benchmarks": ["mine = mx_plugin.bench"],
    }

without an edit here. An entry's name is the name it is registered under (and must equal the
object's own ``name``, where it has one). Entries are loaded on first use, all of a kind at
once (the schema needs every optimizer's fields, the help every command), the shipped ones
first; an entry that fails to import, or two entries of one name, is an error that says so —
nothing is skipped. :meth:`Registry.register` adds one in-process (tests, a script).

Torch-free: the launcher validates recipes against the registries before any rank exists.
"""

from __future__ import annotations

import difflib
import importlib
import threading
from collections.abc import Callable, Iterator, Mapping
from importlib import metadata
from types import MappingProxyType

from megatron_ext.errors import ConfigError

__all__ = ["DISTRIBUTION", "Registry", "UnknownName"]

#: This project's distribution: its entries are the shipped ones (in code); entry points its
#: metadata may still declare (an install older than this code) are not read.
DISTRIBUTION = "megatron-ext"


class UnknownName(ConfigError, KeyError):
    """A name no entry of the registry has (a user's ``trainer:``, ``optimizer.name``, ...)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class Registry[T]:
    """Named objects of one kind, from the entry-point group ``group``.

    ``kind`` names one entry in messages ("trainer"), ``key`` the recipe key a user gives the
    name as (``trainer``: "trainer='x' is not a registered trainer"). ``shipped``: this
    project's entries, name -> ``"module:attribute"`` (a module itself without the colon),
    loaded before any entry point. Every entry must be an ``of``; with ``named`` its ``name``
    attribute is its own name, which the entry's must equal. ``check(obj)``: any further rule;
    raises ``TypeError``. A plugin's mistake is reported with its entry point.
    """

    def __init__(
        self,
        kind: str,
        group: str,
        *,
        of: type[T],
        shipped: Mapping[str, str] | None = None,
        key: str = "",
        named: bool = True,
        check: Callable[[T], None] | None = None,
    ) -> None:
        self.kind = kind
        self.group = group
        self.shipped = dict(shipped or {})
        self.key = key
        self._of = of
        self._named = named
        self._check = check
        self._items: dict[str, T] = {}
        self._origin: dict[str, str] = {}
        self._loaded = False
        self._lock = threading.RLock()  # one thread loads; the others wait for all of it
        self._in_load = False

    def register(self, item: T, name: str | None = None, *, origin: str = "") -> T:
        """Add ``item`` as ``name`` (default: its own name); returns it.

        The same object again is not a second registration; another object under a taken name
        is an error naming both origins."""
        if not isinstance(item, self._of):
            raise TypeError(f"a {self.kind} must be a {self._of.__name__}, not {type(item)}")
        if self._check is not None:
            self._check(item)
        own = getattr(item, "name", None) if self._named else None
        name = name or own
        if not name:
            raise ValueError(f"a {self.kind} needs a name to be registered")
        if own is not None and own != name:
            raise ValueError(f"{origin or self.kind}: registered as {name!r} but named {own!r}")
        if self._items.get(name) is item:
            return item
        if name in self._items:
            raise ValueError(
                f"two {self.kind}s are named {name!r}: {self._origin[name] or 'registered in code'}"
                f" and {origin or 'registered in code'}"
            )
        self._items[name] = item
        self._origin[name] = origin
        return item

    def items(self) -> Mapping[str, T]:
        """Every entry by name (read-only), the shipped ones first, in declaration order."""
        self._load()
        return MappingProxyType(self._items)

    def get(self, name: str) -> T:
        """The entry registered as ``name``; :class:`UnknownName` naming the registered ones."""
        found = self.items()
        if name in found:
            return found[name]
        close = difflib.get_close_matches(name, list(found), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        given = f"{self.key}={name!r}" if self.key else repr(name)
        raise UnknownName(
            f"{given} is not a registered {self.kind}{hint}; registered {self.kind}s: "
            f"{', '.join(sorted(found))}"
        )

    def __contains__(self, name: object) -> bool:
        return name in self.items()

    def __iter__(self) -> Iterator[str]:
        return iter(self.items())

    def _load(self) -> None:
        if self._loaded:
            return
        with self._lock:
            if self._loaded:
                return
            if self._in_load:  # an entry, while it is imported, reads the registry it is in
                raise RuntimeError(
                    f"a {self.kind} read the {self.kind} registry while it was loading (an "
                    "import-time read of the registry in a registered module): read it later"
                )
            self._in_load = True
            try:
                self._load_shipped()
                self._load_entry_points()
            finally:  # loaded once, as far as it got: a failed load is not retried
                self._in_load = False
                self._loaded = True

    def _load_shipped(self) -> None:
        for name, target in self.shipped.items():
            module, _, attr = target.partition(":")
            origin = f"{name} = {target} (shipped)"
            try:
                loaded = importlib.import_module(module)
                item = getattr(loaded, attr) if attr else loaded
            except Exception as err:
                raise RuntimeError(f"{self.kind} {origin} failed to load: {err!r}") from err
            try:
                self.register(item, name, origin=origin)
            except TypeError as err:
                raise TypeError(f"{self.kind} {origin}: {err}") from None

    def _load_entry_points(self) -> None:
        entries = [
            ep
            for ep in metadata.entry_points(group=self.group)
            if ep.dist is None or ep.dist.name != DISTRIBUTION
        ]
        for ep in entries:
            origin = f"entry point {ep.name} = {ep.value} ({ep.dist.name if ep.dist else '?'})"
            try:
                item = ep.load()
            except Exception as err:
                raise RuntimeError(f"{self.group}: {origin} failed to load: {err!r}") from err
            try:
                self.register(item, ep.name, origin=origin)
            except TypeError as err:
                raise TypeError(f"{self.group}: {origin}: {err}") from None
