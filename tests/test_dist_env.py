"""mgpu_helpers.dist_env.exit_at_once: the scripts' way out once their group is destroyed."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_exit_at_once_flushes_output_and_skips_pythons_shutdown() -> None:
    code = textwrap.dedent(
        """
        import atexit, sys
        from mgpu_helpers.dist_env import exit_at_once
        atexit.register(lambda: print("shutdown ran", flush=True))
        print("to stdout, not yet flushed", end="")
        print("to stderr", end="", file=sys.stderr)
        exit_at_once(3)
        print("after the exit")
        """
    )
    # stdout to a pipe is block-buffered: without the flush the text would be lost
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 3
    assert out.stdout == "to stdout, not yet flushed"  # no atexit handler, nothing after
    assert out.stderr == "to stderr"
