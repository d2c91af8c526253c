"""Stand-in for a vLLM (or router) process: answers ``GET /health`` once "booted".

Behaviour comes from env vars so one script covers every launcher scenario:

- ``FAKE_BOOT_S``: seconds before it starts listening (default 0.2)
- ``FAKE_EXIT_CODE``: after booting, print a failure line and exit with this code instead
- ``FAKE_CHILD``: ``1`` spawns a child like vLLM's EngineCore; ``stubborn`` one that ignores
  SIGTERM (the launcher must SIGKILL it)
- ``FAKE_IGNORE_TERM``: ``1`` makes this process ignore SIGTERM itself
- ``FAKE_PID_FILE``: append ``<pid>`` lines for itself and its child
- ``FAKE_ONCE_FILE``: the first process to boot creates this file; any later one (a restart)
  finds it and exits with code 9 after booting, like an instance that cannot come back
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

CHILD_CODE = {
    "1": "import time\nwhile True: time.sleep(1)",
    "stubborn": "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "while True: time.sleep(1)",
}


class Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        code = 200 if self.path == "/health" else 404
        self.send_response(code)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, format: str, *args: object) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", default="fake")
    args, _ = parser.parse_known_args()
    pids = [os.getpid()]
    child = None
    if os.environ.get("FAKE_CHILD") in CHILD_CODE:
        child = subprocess.Popen([sys.executable, "-c", CHILD_CODE[os.environ["FAKE_CHILD"]]])
        pids.append(child.pid)
    if path := os.environ.get("FAKE_PID_FILE"):
        with open(path, "a") as f:
            f.write("".join(f"{pid}\n" for pid in pids))
    if os.environ.get("FAKE_IGNORE_TERM") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"{args.name}: booting", flush=True)
    time.sleep(float(os.environ.get("FAKE_BOOT_S", "0.2")))
    once = os.environ.get("FAKE_ONCE_FILE")
    if once and os.path.exists(once):
        print(f"{args.name}: fake failure: cannot come back", flush=True)
        sys.exit(9)
    if once:
        open(once, "w").close()
    if code := os.environ.get("FAKE_EXIT_CODE"):
        print(f"{args.name}: fake failure: CUDA out of cheese", flush=True)
        sys.exit(int(code))
    server = ThreadingHTTPServer((args.host, args.port), Health)
    print(f"{args.name}: listening on {args.port}", flush=True)
    try:
        server.serve_forever()
    finally:
        if child is not None:
            child.terminate()


if __name__ == "__main__":
    main()
