"""``python -m flatcake``: the ``flatcake`` command, for environments without the console script."""

import sys

from flatcake.cli import main

sys.exit(main())
