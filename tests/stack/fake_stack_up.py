"""``kvtether stack up`` in the foreground, with fake instances: ``fake_stack_up.py SETTINGS_JSON
BEHAVIOUR_JSON``. Lets tests send it Ctrl-C, SIGTERM or SIGKILL like a user would."""

from __future__ import annotations

import json
import sys

from stack_fakes import FakeCommands

from kvtether.cli import configure_logging
from kvtether.stack.cli import run_up
from kvtether.stack.settings import StackSettings

if __name__ == "__main__":
    settings = StackSettings.model_validate_json(sys.argv[1])
    configure_logging("info")
    sys.exit(run_up(settings, commands=FakeCommands(json.loads(sys.argv[2]))))
