"""Progress bars for notebooks that leave a readable line and keep the kernel's status right.

Lesson 02's ``fit`` and the lessons' own loops use :func:`progress_bar`. In a notebook, tqdm's
own bar (``tqdm.notebook``) is an ipywidgets widget, and a widget causes two problems here:

- it lives in the running kernel, so a saved notebook opened later shows "Error displaying
  widget: model not found" where each bar was;
- opening its comm makes JupyterLab (4.5 and later) ask ipykernel 7 for a subshell on the
  control channel. The kernel answers that request with its own "busy" then "idle" status
  messages, and JupyterLab takes that "idle" as the kernel's status: the status bar said
  "Idle" for minutes while a cell with a bar was still running (README, "JupyterLab's kernel
  status").

So here the bar is plain HTML shown under a display id and redrawn by display updates: no
widget and no comm. When the bar closes, one line of plain text replaces it (tqdm's own
summary), which stays readable in the saved file. In a terminal, a script or a child process
it is tqdm's ordinary text bar.
"""

from __future__ import annotations

import functools
import html
import re
import sys
from collections.abc import Iterable

from tqdm.auto import tqdm as auto_tqdm
from tqdm.std import tqdm as std_tqdm

__all__ = ["progress_bar"]

_BAR = "<bar/>"  # where tqdm's meter puts the bar, split out to draw it as a <progress> element


def _in_notebook() -> bool:
    """Whether tqdm.auto chose its notebook bar (it imports tqdm.notebook only then)."""
    notebook = sys.modules.get("tqdm.notebook")
    return notebook is not None and issubclass(auto_tqdm, notebook.tqdm)


def _html(left: str, right: str, n: float, total: float | None) -> str:
    """One bar as HTML: the text before the bar, a <progress> element, the text after it."""
    if total:
        done = f'value="{min(n, total)}" max="{total}"'
    else:  # no total: a bar with no value is drawn as "working", with no position
        done = ""
    text = 'style="white-space: pre; font-family: var(--jp-code-font-family, monospace)"'
    return (
        '<div style="display: flex; align-items: center; gap: 0.5em">'
        f"<span {text}>{html.escape(left)}</span>"
        f'<progress {done} style="flex: 0 1 40ch; min-width: 10ch"></progress>'
        f"<span {text}>{html.escape(right)}</span></div>"
    )


@functools.cache
def _notebook_bar_class() -> type:
    """The notebook bar class, built on first use: plain processes never import IPython."""
    from IPython.display import display

    class NotebookBar(std_tqdm):
        """tqdm drawn as HTML under a display id, redrawn in place, replaced by text at close."""

        def __init__(self, *args: object, **kwargs: object) -> None:
            kwargs["gui"] = True  # tqdm.std then writes to no stream; display() below draws
            kwargs["disable"] = bool(kwargs.get("disable", False))  # None means False here
            self._handle = None
            super().__init__(*args, **kwargs)
            if not self.disable and self.delay <= 0:
                self.display()

        def display(self, msg: str | None = None, pos: int | None = None) -> bool:
            """Draw the bar's current state (tqdm calls this on each refresh)."""
            frame = {"text/html": self._html(), "text/plain": self.format_meter(**self.format_dict)}
            if self._handle is None:
                self._handle = display(frame, raw=True, display_id=True)
            else:
                self._handle.update(frame, raw=True)
            return True

        def clear(self, nolock: bool = False) -> None:
            """Nothing to clear: the bar is a display, not text on a stream (tqdm.write)."""

        def close(self) -> None:
            if self.disable:  # never shown, or closed already (tqdm disables a closed bar)
                return
            super().close()
            if self._handle is not None:
                self._handle.update({"text/plain": self.summary()}, raw=True)
                self._handle = None

        def summary(self) -> str:
            """The bar as one line of text, as tqdm prints it in a terminal."""
            text = self.format_meter(**self.format_dict)
            if self.total and self.n < self.total:
                text += "  (stopped early)"
            return text

        def _html(self) -> str:
            meter = dict(self.format_dict)
            layout = meter.get("bar_format") or "{l_bar}{bar}{r_bar}"
            meter["bar_format"] = layout.replace("{bar}", _BAR)
            left, _, right = self.format_meter(**meter).partition(_BAR)
            # tqdm frames the text bar with "|"; the drawn bar needs no frame
            return _html(re.sub(r"\|$", "", left), re.sub(r"^\|", "", right), self.n, self.total)

    return NotebookBar


def progress_bar(iterable: Iterable | None = None, **kwargs: object) -> auto_tqdm:
    """A tqdm bar (same arguments) that ends as one line of text in a notebook.

    Lesson 02's ``fit`` and the lessons' own loops use it; closing the bar (the end of a
    ``for`` loop over it, or of a ``with`` block) writes the summary in place of the bar.
    """
    if _in_notebook():
        return _notebook_bar_class()(iterable, **kwargs)
    return auto_tqdm(iterable, **kwargs)
