# Run by IPython when a course runner's kernel starts (PYTHONSTARTUP; see tooling/hangs.py).
# On SIGUSR1 the kernel writes every thread's Python stack to the file MGPU_KERNEL_STACKS names.
# It runs in the learner's namespace, so it leaves no name behind (and has no docstring, which
# would become the namespace's __doc__).


def _mgpu_stacks_on_signal() -> None:
    import faulthandler
    import os
    import signal

    path = os.environ.get("MGPU_KERNEL_STACKS")
    if path:  # faulthandler keeps the file open: it writes there when the signal comes
        stacks = open(path, "a")  # noqa: SIM115
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True, chain=False)


_mgpu_stacks_on_signal()
del _mgpu_stacks_on_signal
