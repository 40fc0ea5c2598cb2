"""Stand-in for ``IPython.core`` when a lesson runs as a script (see ../../lesson_kernel.py)."""
