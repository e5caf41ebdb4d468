"""``python -m tiercache``: the same as the ``tiercache`` command."""

import sys

from tiercache.tools.cli import main

sys.exit(main())
