"""Stand-in for ``IPython.display`` when a lesson runs as a script (see ../lesson_kernel.py)."""

from lesson_kernel import (
    HTML,
    JSON,
    SVG,
    Code,
    DisplayHandle,
    Image,
    Javascript,
    Latex,
    Markdown,
    Math,
    Pretty,
    clear_output,
    display,
    update_display,
)

__all__ = [
    "HTML",
    "JSON",
    "SVG",
    "Code",
    "DisplayHandle",
    "Image",
    "Javascript",
    "Latex",
    "Markdown",
    "Math",
    "Pretty",
    "clear_output",
    "display",
    "update_display",
]


def __getattr__(name: str) -> object:
    raise AttributeError(
        f"IPython.display.{name} is not provided when a lesson runs as a script; add it to "
        "scripts/kernel_shim/lesson_kernel.py or avoid it in the lesson"
    )
