"""Stand-in for ``IPython.core.getipython`` (see ../../lesson_kernel.py)."""

from lesson_kernel import get_ipython

__all__ = ["get_ipython"]
