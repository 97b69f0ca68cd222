"""Decoding: options (:mod:`.options`), engines (:mod:`.engines`), strategies
(:mod:`.strategies`) and their generators. Importing this package imports none of its modules:
the registries of engines and strategies name the module of each, imported when a run first
asks for it (:mod:`.registry`), so a run loads what it decodes with and no more."""
