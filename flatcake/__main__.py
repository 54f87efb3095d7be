"""``python -m flatcake``: the same command line as ``flatcake``."""

import sys

from flatcake.cli import main

sys.exit(main())
