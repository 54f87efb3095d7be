"""``python -m flatcake.cli``."""

import sys

from flatcake.cli import main

sys.exit(main())
