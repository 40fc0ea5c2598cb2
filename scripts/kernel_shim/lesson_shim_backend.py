"""The matplotlib backend of a lesson running as a script (``MPLBACKEND=module://...``).

Agg draws; ``plt.show()`` saves the open figures as PNG files and closes them, as the inline
backend shows them in a notebook (see lesson_kernel.flush_figures).
"""

import lesson_kernel
from matplotlib.backend_bases import FigureManagerBase
from matplotlib.backends.backend_agg import FigureCanvasAgg

FigureCanvas = FigureCanvasAgg
FigureManager = FigureManagerBase


def show(*args: object, **kwargs: object) -> None:
    """Save every open pyplot figure under the lesson's figures/ folder, then close it."""
    lesson_kernel.flush_figures()
