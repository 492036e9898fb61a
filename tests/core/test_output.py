"""forge_obs's lines and what a user's callback prints never interleave (core/safe.py)."""

import io
import sys
import threading

from forge_obs.core.safe import printing, write_line


class _Chunks(io.StringIO):
    """A stream whose every ``write`` is a chance for another thread to run."""

    def write(self, s):  # noqa: D401 - io's name
        n = super().write(s)
        threading.Event().wait(0)  # yields the GIL between the writes of one print
        return n


def _run(wrap):
    out = _Chunks()
    block = "=" * 20 + " step 1 " + "=" * 20
    stop = threading.Event()

    def console():
        while not stop.is_set():
            write_line(out, block)

    cb = wrap(lambda alert: print("ALERT", alert["state"], alert["rule"], file=out))
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    t = threading.Thread(target=console)
    t.start()
    try:
        for _ in range(3000):
            cb({"state": "firing", "rule": "threshold"})
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(old)
    return out.getvalue().splitlines(), block


def test_a_printing_callback_lands_between_forge_obs_lines():
    lines, block = _run(printing)
    assert lines.count("ALERT firing threshold") == 3000
    assert set(lines) == {"ALERT firing threshold", block}


def test_without_it_the_lines_interleave():
    """The same threads without :func:`printing`: ``print``'s writes are split by a block (what
    the test above rules out could happen)."""
    lines, block = _run(lambda fn: fn)
    assert set(lines) - {"ALERT firing threshold", block}
