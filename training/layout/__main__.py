"""python -m training.layout: the layout `topology = "auto"` would choose (training/layout/roles.py)."""

import sys

from training.layout.roles import main

sys.exit(main())
