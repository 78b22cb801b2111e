"""The cluster simulator: traces replayed through maitre's own scheduling policy (issue 5, begun:
the event engine and the traces in ``sim/traces``)."""
