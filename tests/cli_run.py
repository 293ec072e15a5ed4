"""`python -m futx ARGS` in a child process on this checkout's code, for the CLI tests."""

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def futx(args, cwd, timeout=120):
    """Run the CLI with ARGS in `cwd`: (status, stdout, stderr, seconds)."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "futx", *args], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=timeout)
    return r.returncode, r.stdout, r.stderr, time.perf_counter() - t0
