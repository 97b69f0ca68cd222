"""The registries of decoding strategies (``--decoding``) and decoder engines
(``--decoder-engine``): name -> what registered under it, where the built-in names are known
before their modules are imported.

A registry's catalog lists each built-in name with the module that registers it and its line
of ``--help``. Listing the names, reading their help or checking that a name exists imports
nothing; reading a name imports its module (which registers it, :meth:`Registry.register`), so
a run loads the strategy and the engine it decodes with and no other. Reading every entry
(``values()``, ``items()``) imports every module of the catalog. A name outside the catalog
(a test's, a further plugin's) is registered by importing its module first, as before.
"""

import importlib
from collections.abc import Mapping
from typing import Callable, Dict, Iterator, NamedTuple, Tuple


class Entry(NamedTuple):
    """A built-in name: its module and what the registered class declares, known without it."""

    module: str  # the module that registers the name when imported
    summary: str  # its line of --help
    own_options: Tuple[str, ...] = ()  # an engine's own options (DecoderEngine.own_options)


DECLARED = Entry._fields[1:]  # the class attributes a catalog entry states


class Registry(Mapping):
    """``name -> registered object`` of one kind (``"decoding strategy"``, ``"decoder engine"``),
    in ``order`` (a sort key of names) whatever order the modules are imported in."""

    def __init__(self, kind: str, catalog: Dict[str, Entry], order: Callable[[str], object] = str):
        self.kind = kind
        self.catalog = dict(catalog)
        self.order = order
        self._registered: Dict[str, object] = {}

    def registered(self, name: str):
        """What is registered under ``name`` so far (``None``: nothing yet), importing nothing."""
        return self._registered.get(name)

    def register(self, name: str, cls: type, value):
        """Register ``value`` (``cls`` or an instance of it) under ``name``. What the catalog
        states of a name (:data:`DECLARED`) is set on ``cls``; a class that states it otherwise is
        refused (one statement per name)."""
        entry = self.catalog.get(name)
        for attribute in DECLARED if entry is not None else ():
            stated, own = getattr(entry, attribute), cls.__dict__.get(attribute)  # not inherited
            if own is None and not stated and not hasattr(cls, attribute):
                continue  # an attribute of the other kind (a strategy has no own options)
            if own not in (None, "", (), stated):
                raise ValueError(f"{self.kind} {name!r}: {cls.__name__}.{attribute} is not the catalog's; keep one")
            setattr(cls, attribute, stated)
        self._registered[name] = value

    def declared(self, name: str, attribute: str):
        """What ``name`` declares (one of :data:`DECLARED`), without importing its module."""
        entry = self.catalog.get(name)
        return getattr(entry, attribute) if entry is not None else getattr(self._registered[name], attribute)

    def copy(self) -> "Registry":
        """A registry of the same catalog holding every entry of this one (a test registers its
        own entries in a copy). The catalog's modules are imported first, so that they register
        here and not only in the copy."""
        copied = Registry(self.kind, self.catalog, self.order)
        copied._registered.update((name, self[name]) for name in self)
        return copied

    def __getitem__(self, name: str):
        if name not in self._registered and name in self.catalog:
            importlib.import_module(self.catalog[name].module)
        try:
            return self._registered[name]
        except KeyError:
            if name in self.catalog:  # a module being imported, or one that forgot to register
                raise KeyError(f"{self.kind} {name!r} is not registered by {self.catalog[name].module}") from None
            raise

    def __contains__(self, name) -> bool:
        return name in self._registered or name in self.catalog

    def __iter__(self) -> Iterator[str]:
        return iter(sorted({*self.catalog, *self._registered}, key=self.order))

    def __len__(self) -> int:
        return len({*self.catalog, *self._registered})
