"""``python -m ampddp``: the same as the ``ampddp`` command."""

import sys

from ampddp.cli import main

sys.exit(main())
