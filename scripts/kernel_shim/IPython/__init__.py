"""Stand-in for IPython when a lesson runs as a script (see ../lesson_kernel.py).

Only what lessons and the libraries they use reach for: ``get_ipython``, ``display`` and
``version_info`` (matplotlib reads it). It shadows a real IPython on purpose, so a lesson behaves
the same whether or not the Jupyter stack is installed.
"""

from lesson_kernel import display, get_ipython

__all__ = ["display", "get_ipython", "version_info"]

__version__ = "8.99.0+lesson-script-shim"
version_info = (8, 99, 0, "lesson-script-shim")
