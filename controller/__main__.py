"""``python -m milepost ...``: the ``milepost`` command."""

import sys

from milepost._cli import main

sys.exit(main())
