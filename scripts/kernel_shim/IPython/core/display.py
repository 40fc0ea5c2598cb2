"""Stand-in for ``IPython.core.display`` (see ../../lesson_kernel.py)."""

import IPython.display as _display

__all__ = list(_display.__all__)
globals().update({name: getattr(_display, name) for name in __all__})
