"""``python -m kvtether``: the same as the ``kvtether`` console script."""

import sys

from kvtether.cli import main

sys.exit(main())
