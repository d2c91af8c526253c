"""``python -m kvtether.harness claude-code``: the Claude Code hook without the ``kvtether``
CLI's start-up (which loads the router's and stack's settings: half a second per tool call).
``python -m kvtether.harness beat ...`` is how a hook starts a beater."""

from __future__ import annotations

import sys

from kvtether.harness._entry import main

sys.exit(main(sys.argv[1:]))
