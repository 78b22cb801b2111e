"""The cluster simulator: traces replayed (``sim/traces``) through maitre's own scheduling
policy, on a discrete-event engine."""
