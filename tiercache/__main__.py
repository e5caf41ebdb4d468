"""``python -m tiercache``: the same as the ``tiercache`` command."""

import sys

from tiercache.cli import main

sys.exit(main())
