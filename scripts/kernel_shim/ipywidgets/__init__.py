"""Stand-in for ipywidgets when a lesson runs as a script (see ../lesson_kernel.py).

A script has no front end to draw a widget or move a slider, so each widget only holds its
``value`` (its default, as the slider would start), and ``interact(f, ...)`` /
``interactive(f, ...)`` call ``f`` once with those starting values: the code behind every
interactive cell runs, and whatever it displays (a figure) is saved. ``interact_manual`` calls
``f`` once too, although a notebook waits for the button. Callbacks (``observe``, ``on_click``)
are accepted and never fire, as no one moves a slider.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

__version__ = "8.99.0+lesson-script-shim"


class Layout:
    """Accepts any layout attribute and keeps it."""

    def __init__(self, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)


class Widget:
    """A widget without a front end: its attributes, a value, and inert callbacks."""

    _default_value: Any = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if args and isinstance(self, Box):  # HBox([a, b])
            kwargs.setdefault("children", args[0])
        self.description = kwargs.pop("description", "")
        self.layout = kwargs.pop("layout", None) or Layout()
        self.style = kwargs.pop("style", None) or {}
        self.children = tuple(kwargs.pop("children", ()))
        self.__dict__.update(kwargs)
        if "value" not in kwargs:
            self.value = self._initial_value()
        self.callbacks: list[Callable[..., Any]] = []

    def _initial_value(self) -> Any:
        return self._default_value

    def __repr__(self) -> str:
        label = f", description={self.description!r}" if self.description else ""
        return f"{type(self).__name__}(value={getattr(self, 'value', None)!r}{label})"

    # What a front end would trigger: accepted, never called in a script.
    def observe(self, handler: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self.callbacks.append(handler)

    def unobserve(self, *args: Any, **kwargs: Any) -> None:
        pass

    def on_click(self, handler: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self.callbacks.append(handler)

    def on_submit(self, handler: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self.callbacks.append(handler)

    def close(self) -> None:
        pass

    def add_class(self, name: str) -> Widget:
        return self

    def remove_class(self, name: str) -> Widget:
        return self

    def set_title(self, index: int, title: str) -> None:
        pass

    # Output's context manager and helpers: text written inside simply goes to the log.
    def __enter__(self) -> Widget:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def clear_output(self, *args: Any, **kwargs: Any) -> None:
        pass

    def append_stdout(self, text: str) -> None:
        sys.stdout.write(text)

    def append_stderr(self, text: str) -> None:
        sys.stderr.write(text)

    def capture(self, *args: Any, **kwargs: Any) -> Callable[[Callable[..., Any]], Any]:
        return lambda function: function


class _Numeric(Widget):
    _default_value = 0

    def _initial_value(self) -> Any:
        return getattr(self, "min", self._default_value)


class IntSlider(_Numeric):
    def __init__(
        self, value: int | None = None, min: int = 0, max: int = 100, step: int = 1, **kwargs: Any
    ) -> None:
        super().__init__(min=min, max=max, step=step, **kwargs)
        self.value = min if value is None else value


class FloatSlider(_Numeric):
    def __init__(
        self,
        value: float | None = None,
        min: float = 0.0,
        max: float = 10.0,
        step: float = 0.1,
        **kwargs: Any,
    ) -> None:
        super().__init__(min=min, max=max, step=step, **kwargs)
        self.value = min if value is None else value


class FloatLogSlider(Widget):
    _default_value = 1.0


class IntRangeSlider(Widget):
    _default_value = (25, 75)


class FloatRangeSlider(Widget):
    _default_value = (2.5, 7.5)


class IntText(_Numeric):
    pass


class BoundedIntText(_Numeric):
    pass


class FloatText(_Numeric):
    _default_value = 0.0


class BoundedFloatText(_Numeric):
    _default_value = 0.0


class Play(_Numeric):
    pass


class IntProgress(_Numeric):
    pass


class FloatProgress(_Numeric):
    _default_value = 0.0


class Checkbox(Widget):
    _default_value = False


class ToggleButton(Widget):
    _default_value = False


class Text(Widget):
    _default_value = ""


class Textarea(Text):
    pass


class Label(Text):
    pass


class HTML(Text):
    pass


class HTMLMath(Text):
    pass


class Button(Widget):
    pass


class Output(Widget):
    pass


class ColorPicker(Widget):
    _default_value = "black"


class DatePicker(Widget):
    pass


def _option_values(options: Any) -> list[Any]:
    if isinstance(options, dict):
        return list(options.values())
    values = list(options or ())
    return [o[1] if isinstance(o, tuple) and len(o) == 2 else o for o in values]


class _Selection(Widget):
    """Dropdown and friends: the first option is selected, as in a front end."""

    def _initial_value(self) -> Any:
        values = _option_values(getattr(self, "options", ()))
        return values[0] if values else None


class Dropdown(_Selection):
    pass


class RadioButtons(_Selection):
    pass


class Select(_Selection):
    pass


class ToggleButtons(_Selection):
    pass


class SelectionSlider(_Selection):
    pass


class SelectMultiple(Widget):
    _default_value = ()


class Box(Widget):
    pass


class HBox(Box):
    pass


class VBox(Box):
    pass


class GridBox(Box):
    pass


class Tab(Box):
    pass


class Accordion(Box):
    pass


def link(*args: Any, **kwargs: Any) -> None:
    """Nothing moves in a script, so there is nothing to keep in sync."""


jslink = jsdlink = dlink = link


class fixed:  # noqa: N801 (ipywidgets' name)
    """A fixed argument of ``interact``: passed as is, no widget."""

    def __init__(self, value: Any) -> None:
        self.value = value


def _start_value(abbrev: Any, default: Any) -> Any:
    """The value the widget that ``interact`` builds from ``abbrev`` would start with."""
    if isinstance(abbrev, (Widget, fixed)):
        return abbrev.value
    if isinstance(abbrev, bool) or isinstance(abbrev, str):
        return abbrev
    if (
        isinstance(abbrev, tuple)
        and 2 <= len(abbrev) <= 3
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in abbrev)
    ):
        low, high = abbrev[0], abbrev[1]
        if default is not inspect.Parameter.empty and low <= default <= high:
            return default
        middle = low + (high - low) / 2
        return int(middle) if all(isinstance(v, int) for v in abbrev) else middle
    if isinstance(abbrev, (list, tuple, dict)):
        values = _option_values(abbrev)
        if default is not inspect.Parameter.empty and default in values:
            return default
        return values[0] if values else None
    return abbrev  # a number: ipywidgets builds a slider around it, starting there


def _start_values(function: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    try:
        defaults = {name: p.default for name, p in inspect.signature(function).parameters.items()}
    except (TypeError, ValueError):
        defaults = {}
    return {
        name: _start_value(abbrev, defaults.get(name, inspect.Parameter.empty))
        for name, abbrev in kwargs.items()
    }


class _Interact:
    """``interact(f, **widgets)`` and ``@interact(**widgets)``: call ``f`` once, return it."""

    def __call__(self, function: Callable[..., Any] | None = None, /, **kwargs: Any) -> Any:
        if function is None:
            return lambda function: self(function, **kwargs)
        function(**_start_values(function, kwargs))
        return function

    def options(self, **options: Any) -> _Interact:
        return self


interact = _Interact()
interact_manual = _Interact()


class interactive(VBox):  # noqa: N801 (ipywidgets' name)
    """``interactive(f, **widgets)``: calls ``f`` once; ``result`` holds what it returned."""

    def __init__(self, function: Callable[..., Any], /, **kwargs: Any) -> None:
        super().__init__()
        self.kwargs = _start_values(function, kwargs)
        self.children = tuple(w for w in kwargs.values() if isinstance(w, Widget))
        self.result = function(**self.kwargs)

    def __repr__(self) -> str:
        return f"interactive({self.kwargs})"


widgets = sys.modules[__name__]  # `from ipywidgets import widgets; widgets.IntSlider(...)`


def __getattr__(name: str) -> Any:
    raise AttributeError(
        f"ipywidgets.{name} is not provided when a lesson runs as a script; add it to "
        "scripts/kernel_shim/ipywidgets/__init__.py or avoid it in the lesson"
    )
