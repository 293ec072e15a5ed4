"""Atomic writes: a result file is either its old content or its new content, never half of one.

The new content goes to a temporary file in the same directory (so the rename stays on one file system)
and `os.replace` puts it in place; an exception (Ctrl-C included) removes the temporary file, and a Ctrl-C while
the file is being created waits until its name is known.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import threading
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def replacing(path: str | os.PathLike) -> Iterator[Path]:
    """Yields a temporary path beside `path` (same suffix, so writers that pick a format by it still work);
    on a clean exit it replaces `path`."""
    path = Path(path)
    tmp = None
    try:
        with _interrupts_deferred():   # a Ctrl-C between creating the file and knowing its name would leak it
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix or ".tmp")
            os.close(fd)
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 would make results private to this user
        os.replace(tmp, path)
    except BaseException:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM held back (delivered on exit) in the main thread, where Python runs signal handlers.

    Held at the Python handler, not by the thread's signal mask: the kernel hands a process-directed signal to any
    thread that does not block it (torch's worker threads), whose C handler flags it for the main thread's next
    bytecode all the same."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list = []
    old = {s: signal.signal(s, lambda signum, frame: held.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        for s in held:
            signal.raise_signal(s)   # to the handler that was there before


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text(path: str | os.PathLike, text: str) -> None:
    with replacing(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
