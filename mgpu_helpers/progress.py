"""Progress bars that leave a readable line in a saved notebook (lesson 02 on: ``fit``'s bars).

In a notebook tqdm draws a widget, and a widget lives in the running kernel: a notebook that
is saved and opened again later shows "Error displaying widget: model not found" where each
bar was (unless the widget state was saved with it, see lesson 00). :func:`progress_bar` shows
the same live widget while it runs and, when the bar closes, replaces it with one line of
plain text, tqdm's own summary, which stays readable in the saved file. In a terminal, a
script or a child process it is tqdm's ordinary text bar.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterable

from tqdm.auto import tqdm as auto_tqdm

__all__ = ["progress_bar"]


def _in_notebook() -> bool:
    """Whether tqdm.auto chose its notebook widget (it imports tqdm.notebook only then)."""
    notebook = sys.modules.get("tqdm.notebook")
    return notebook is not None and issubclass(auto_tqdm, notebook.tqdm)


@functools.cache
def _notebook_bar_class() -> type:
    """The widget bar class, built on first use: plain processes never import ipywidgets."""
    from IPython.display import display
    from tqdm.notebook import tqdm as notebook_tqdm

    class NotebookBar(notebook_tqdm):
        """tqdm's notebook widget, shown under a display id and replaced by text when closed."""

        def __init__(self, *args: object, **kwargs: object) -> None:
            kwargs["display"] = False  # shown below instead, keeping the handle to replace it
            super().__init__(*args, **kwargs)
            self._handle = None
            if not self.disable:
                self._handle = display(self.container, display_id=True)
                self.displayed = True

        def close(self) -> None:
            if self.disable:  # never shown, or closed already (tqdm disables a closed bar)
                return
            super().close()
            if self._handle is not None:
                self._handle.update({"text/plain": self.summary()}, raw=True)
                self._handle = None
                # The text replaced the widget: close its models too (each part's layout and
                # style are models of their own), so that a saved notebook carries no state
                # for bars that nothing shows any more.
                for widget in (*self.container.children, self.container):
                    for model in (getattr(widget, "style", None), widget.layout, widget):
                        if model is not None:
                            model.close()

        def summary(self) -> str:
            """The bar as one line of text, as tqdm prints it in a terminal."""
            text = self.format_meter(**self.format_dict)
            if self.total and self.n < self.total:
                text += "  (stopped early)"
            return text

    return NotebookBar


def progress_bar(iterable: Iterable | None = None, **kwargs: object) -> auto_tqdm:
    """A tqdm bar (same arguments) that ends as one line of text in a notebook.

    Lesson 02's ``fit`` and the lessons' own loops use it; closing the bar (the end of a
    ``for`` loop over it, or of a ``with`` block) writes the summary in place of the widget.
    """
    if _in_notebook():
        return _notebook_bar_class()(iterable, **kwargs)
    return auto_tqdm(iterable, **kwargs)
