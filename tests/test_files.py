"""Checks of input and output paths (futx.files) and atomic writes (futx.atomic)."""

import os

import pytest

from futx import atomic, files


def test_input_files_are_existing_regular_files(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("x")
    assert files.input_file(f) == f
    with pytest.raises(ValueError, match="is a directory, not a file"):
        files.input_file(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        files.input_file(tmp_path / "missing")
    if os.path.exists("/dev/null"):
        with pytest.raises(ValueError, match="not a regular file"):
            files.input_file("/dev/null")


def test_text_must_be_utf8_and_the_message_names_the_first_bad_byte(tmp_path):
    good = tmp_path / "good.txt"
    good.write_text("héllo\nwörld\n", encoding="utf-8")
    assert files.read_text(good) == "héllo\nwörld\n"
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("abc é".encode("latin-1"))
    with pytest.raises(ValueError, match=r"not UTF-8 text: byte 4 \(0xe9\)"):
        files.read_text(latin1)
    binary = tmp_path / "zeros.bin"
    binary.write_bytes(b"ab\0\0")
    with pytest.raises(ValueError, match="byte 2 is a NUL byte"):
        files.read_text(binary)


def test_output_paths(tmp_path):
    assert files.output_file(tmp_path / "r.json") == tmp_path / "r.json"
    with pytest.raises(ValueError, match="is a directory; give a file name"):
        files.output_file(tmp_path)
    with pytest.raises(ValueError, match="directory .*nope does not exist"):
        files.output_file(tmp_path / "nope" / "r.json")
    (tmp_path / "plain").write_text("")
    with pytest.raises(ValueError, match="plain is not a directory"):
        files.output_file(tmp_path / "plain" / "r.json")
    assert files.output_dir(tmp_path / "new") == tmp_path / "new"       # made later, in an existing directory
    assert files.output_dir(tmp_path) == tmp_path
    with pytest.raises(ValueError, match="exists and is not a directory"):
        files.output_dir(tmp_path / "plain")
    with pytest.raises(ValueError, match="does not exist"):
        files.output_dir(tmp_path / "nope" / "deeper")


def test_atomic_write_replaces_whole_or_not_at_all(tmp_path):
    path = tmp_path / "r.json"
    atomic.write_text(path, "old")
    with pytest.raises(KeyboardInterrupt):
        with atomic.replacing(path) as tmp:
            assert tmp.parent == tmp_path and tmp.suffix == ".json"
            tmp.write_text("half")
            raise KeyboardInterrupt
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["r.json"]   # no temporary file left
    atomic.write_text(path, "new")
    assert path.read_text() == "new" and os.listdir(tmp_path) == ["r.json"]
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


def test_a_ctrl_c_while_the_temporary_file_is_created_leaves_none_behind(tmp_path, monkeypatch):
    """The signal arrives right after mkstemp made the file (before its name reached the writer): it is held back
    until the name is known, then raised inside the cleanup's reach (the flaky interrupted-ppl CLI test)."""
    import signal
    import tempfile

    real = tempfile.mkstemp

    def mkstemp_then_ctrl_c(*a, **k):
        out = real(*a, **k)
        os.kill(os.getpid(), signal.SIGINT)   # pending while blocked; a KeyboardInterrupt here without the fix
        return out

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        atomic.write_text(tmp_path / "r.json", "x")
    assert os.listdir(tmp_path) == []


def test_a_ctrl_c_that_another_thread_receives_is_held_back_too():
    """A process-directed SIGINT goes to any thread that does not block it (torch's workers): its C handler flags the
    main thread all the same, which `_thread.interrupt_main` does directly. The hold must be at Python's handler, not
    the main thread's signal mask (the flaky interrupted-ppl CLI test once more)."""
    import _thread
    import signal

    steps = []
    with pytest.raises(KeyboardInterrupt):
        with atomic._interrupts_deferred():
            _thread.interrupt_main(signal.SIGINT)
            for _ in range(10000):   # bytecode boundaries, where Python would raise the KeyboardInterrupt
                pass
            steps.append("finished")
    assert steps == ["finished"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
