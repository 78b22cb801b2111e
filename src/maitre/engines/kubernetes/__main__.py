"""``python -m maitre.engines.kubernetes crd|manifest``: see :mod:`maitre.engines.kubernetes.crd`."""

import sys

from maitre.engines.kubernetes.crd import main

sys.exit(main())
