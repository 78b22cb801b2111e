"""The web dashboard: one page, built in the browser from the coordinator's event log, live
(:mod:`maitre.control.api` mounts :mod:`.routes`) or replayed from a recorded log
(``maitre dashboard DIR``: :mod:`.replay`, :mod:`.server`); who may see it: :mod:`.auth`."""
