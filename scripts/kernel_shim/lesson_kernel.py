"""What a Jupyter kernel gives a lesson, for running its code as a plain script (gpu_check.sh).

``scripts/lesson_as_script.py`` puts this folder first on the lesson process's ``sys.path``
(and on ``PYTHONPATH``, so the launcher's child processes see it too). The ``IPython``,
``IPython.display`` and ``ipywidgets`` packages next to this file are thin stand-ins that
forward here, so a lesson's imports work without the Jupyter stack. What it provides:

- ``display(...)``: a matplotlib figure becomes a PNG file under ``<out>/figures/``; a MIME
  bundle (``raw=True``) or an object's ``_repr_*_`` methods print their ``text/plain``; every
  ``application/vnd.mgpu...`` item (what ``mgpu_helpers.record.record`` and the self-checks
  publish) is kept in ``<out>/displays.json``, one entry per item, in order.
- ``get_ipython()``: a small shell with the line and cell magics the lessons may use
  (``%matplotlib``, ``%time``, ``%env``, ``%%writefile``, ...), ``!shell`` commands and the
  ``post_execute`` event matplotlib registers for. In any other process (a launched rank) it
  returns ``None``, as outside a kernel, so the package prints instead of displaying there.
- pyplot figures still open at the end of a cell are saved and closed, as the inline backend
  shows and closes them (``flush_figures``).

Standard library only; matplotlib is imported only when a lesson uses it.
"""

from __future__ import annotations

import base64
import html
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "MGPU_MIME_PREFIX",
    "Shell",
    "clear_output",
    "configure",
    "display",
    "flush_figures",
    "get_ipython",
    "set_cell",
    "update_display",
]

MGPU_MIME_PREFIX = "application/vnd.mgpu"
DISPLAYS_FILE = "displays.json"
FIGURES_DIR = "figures"


class _State:
    """Where this lesson's outputs go; unset (``out_dir is None``) outside the lesson process."""

    def __init__(self) -> None:
        self.out_dir: Path | None = None
        self.cell = -1  # index in the notebook of the cell that runs now
        self.figures_in_cell = 0
        self.displays: list[dict[str, Any]] = []
        self.figures: list[str] = []
        self.shell: Shell | None = None


_STATE = _State()


def configure(out_dir: str | Path, user_ns: dict[str, Any]) -> Shell:
    """Make this process the lesson's "kernel": outputs go to ``out_dir``; returns the shell."""
    _STATE.out_dir = Path(out_dir)
    (_STATE.out_dir / FIGURES_DIR).mkdir(parents=True, exist_ok=True)
    _STATE.displays = []
    _STATE.figures = []
    _STATE.shell = Shell(user_ns)
    _write_displays()
    return _STATE.shell


def set_cell(index: int) -> None:
    """Tell the shim which notebook cell runs now (names figures, tags displays)."""
    _STATE.cell = index
    _STATE.figures_in_cell = 0


def get_ipython() -> Shell | None:
    """The shell in the lesson's own process; None elsewhere (as outside a kernel)."""
    return _STATE.shell


# --- display ------------------------------------------------------------------------------


class DisplayHandle:
    """What ``display(..., display_id=...)`` returns; ``update`` displays again."""

    def __init__(self, display_id: str) -> None:
        self.display_id = display_id

    def display(self, obj: object, **kwargs: Any) -> None:
        display(obj, **kwargs)

    def update(self, obj: object, **kwargs: Any) -> None:
        display(obj, **kwargs)

    def __repr__(self) -> str:
        return f"<DisplayHandle display_id={self.display_id}>"


def display(
    *objs: object,
    include: Any = None,
    exclude: Any = None,
    metadata: dict[str, Any] | None = None,
    transient: Any = None,
    display_id: str | bool | None = None,
    raw: bool = False,
    clear: bool = False,
    **kwargs: Any,
) -> DisplayHandle | None:
    """Show each object the way a script can: text printed, figures saved, records kept."""
    for obj in objs:
        if raw:
            if not isinstance(obj, dict):
                raise TypeError(
                    f"display(..., raw=True) takes MIME bundles (dicts), got {type(obj).__name__}"
                )
            _publish(dict(obj), metadata or {})
        else:
            data, md = _bundle(obj)
            _publish(data, {**md, **(metadata or {})})
    if display_id:
        return DisplayHandle(str(display_id) if display_id is not True else f"{time.time_ns()}")
    return None


def update_display(obj: object, *, display_id: str, **kwargs: Any) -> None:
    """``IPython.display.update_display``: in a script, displays the new value again."""
    display(obj, **kwargs)


def clear_output(wait: bool = False) -> None:
    """Nothing to clear in a log."""


def _is_figure(obj: object) -> bool:
    return hasattr(obj, "savefig") and hasattr(obj, "canvas")


def _bundle(obj: object) -> tuple[dict[str, Any], dict[str, Any]]:
    """The MIME bundle IPython would build for ``obj`` (the parts a script can use)."""
    if _is_figure(obj):
        return {"image/png": _figure_png(obj), "text/plain": repr(obj)}, {}
    if hasattr(obj, "_repr_mimebundle_"):
        try:
            got = obj._repr_mimebundle_(include=None, exclude=None)
        except TypeError:
            got = obj._repr_mimebundle_()
        if got is not None:
            data, md = got if isinstance(got, tuple) else (got, {})
            data = dict(data)
            data.setdefault("text/plain", repr(obj))
            return data, dict(md or {})
    data: dict[str, Any] = {}
    for mime, method in (
        ("image/png", "_repr_png_"),
        ("text/html", "_repr_html_"),
        ("text/markdown", "_repr_markdown_"),
        ("text/latex", "_repr_latex_"),
        ("application/json", "_repr_json_"),
    ):
        if hasattr(obj, method) and not isinstance(obj, type):
            value = getattr(obj, method)()
            if value is not None:
                data[mime] = value
    data["text/plain"] = _plain(obj)
    return data, {}


def _plain(obj: object) -> str:
    text = getattr(obj, "_shim_text", None)  # the shim's HTML/Markdown objects
    return text if isinstance(text, str) else repr(obj)


def _publish(data: dict[str, Any], metadata: dict[str, Any]) -> None:
    for mime, value in data.items():
        if mime.startswith(MGPU_MIME_PREFIX):
            _keep(mime, value, metadata.get(mime, metadata))
    for mime, value in metadata.items():  # a marker may travel as metadata only
        if mime.startswith(MGPU_MIME_PREFIX) and mime not in data:
            _keep(mime, value, {})
    if "image/png" in data:
        png = data["image/png"]
        path = _save_png(png if isinstance(png, bytes) else base64.b64decode(png))
        if path is not None:
            print(f"[figure saved: {path}]", flush=True)
            return
    if "text/plain" in data:
        print(data["text/plain"], flush=True)
    elif "text/markdown" in data:
        print(data["text/markdown"], flush=True)
    elif "text/html" in data:
        print(_strip_tags(str(data["text/html"])), flush=True)


def _strip_tags(text: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", text)).strip()


def _keep(mime: str, value: Any, metadata: Any) -> None:
    if isinstance(value, str):  # some front ends send JSON as text
        try:
            value = json.loads(value)
        except ValueError:
            pass
    entry = {"cell": _STATE.cell, "mime": mime, "data": value}
    if metadata:
        entry["metadata"] = metadata
    _STATE.displays.append(entry)
    _write_displays()


def _write_displays() -> None:
    if _STATE.out_dir is None:
        return
    path = _STATE.out_dir / DISPLAYS_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(_STATE.displays, indent=1, default=repr) + "\n")
    os.replace(tmp, path)  # a lesson killed mid-write still leaves a whole file


def _figure_png(fig: Any) -> bytes:
    import io

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    return buffer.getvalue()


def _save_png(png: bytes) -> str | None:
    if _STATE.out_dir is None:
        return None
    _STATE.figures_in_cell += 1
    name = f"cell{_STATE.cell:03d}-{_STATE.figures_in_cell}.png"
    path = _STATE.out_dir / FIGURES_DIR / name
    path.write_bytes(png)
    relative = f"{FIGURES_DIR}/{name}"
    _STATE.figures.append(relative)
    return relative


def flush_figures() -> None:
    """Save and close the pyplot figures still open (the inline backend's end of a cell)."""
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is None:
        return
    for number in pyplot.get_fignums():
        display(pyplot.figure(number))
    pyplot.close("all")


# --- the shell: magics, shell commands, events --------------------------------------------


class _Events:
    """The part of IPython's event manager that libraries use (matplotlib registers here)."""

    def __init__(self) -> None:
        self.callbacks: dict[str, list[Callable[..., Any]]] = {}

    def register(self, event: str, function: Callable[..., Any]) -> None:
        self.callbacks.setdefault(event, []).append(function)

    def unregister(self, event: str, function: Callable[..., Any]) -> None:
        self.callbacks.get(event, []).remove(function)

    def trigger(self, event: str, *args: Any) -> None:
        for function in list(self.callbacks.get(event, [])):
            function(*args)


_QUIET_MAGICS = {"config", "load_ext", "reload_ext", "autoreload", "aimport", "xmode", "precision"}


class Shell:
    """What ``get_ipython()`` returns in the lesson process: magics and ``!`` commands."""

    def __init__(self, user_ns: dict[str, Any]) -> None:
        self.user_ns = user_ns
        self.events = _Events()
        self.config: dict[str, Any] = {}  # no IPKernelApp: libraries pick their console mode
        self.kernel = None

    def __repr__(self) -> str:
        return "<lesson_kernel.Shell: a lesson running as a script, not a Jupyter kernel>"

    def enable_gui(self, gui: str | None = None) -> None:
        """No GUI event loop in a script."""

    # `!cmd` and `x = !cmd`
    def system(self, cmd: str) -> int:
        result = subprocess.run(
            self.var_expand(cmd), shell=True, capture_output=True, text=True, check=False
        )
        sys.stdout.write(result.stdout)
        sys.stderr.write(result.stderr)
        sys.stdout.flush()
        self.user_ns["_exit_code"] = result.returncode
        return result.returncode

    def getoutput(self, cmd: str) -> list[str]:
        result = subprocess.run(
            self.var_expand(cmd), shell=True, capture_output=True, text=True, check=False
        )
        return (result.stdout + result.stderr).splitlines()

    def var_expand(self, cmd: str) -> str:
        """IPython's expansion in shell commands: ``{expression}``, ``$name``, ``$$`` -> ``$``."""

        def expression(match: re.Match[str]) -> str:
            try:
                return str(eval(match.group(1), self.user_ns))
            except Exception:  # as IPython does: leave what does not evaluate as written
                return match.group(0)

        def name(match: re.Match[str]) -> str:
            key = match.group(1)
            return str(self.user_ns[key]) if key in self.user_ns else match.group(0)

        cmd = re.sub(r"(?<![$]){([^{}]+)}", expression, cmd)
        cmd = re.sub(r"(?<![$])[$]([A-Za-z_]\w*)", name, cmd)
        return cmd.replace("$$", "$")

    def magic(self, line: str) -> Any:
        name, _, rest = line.lstrip("%").partition(" ")
        return self.run_line_magic(name, rest)

    def run_line_magic(self, name: str, line: str, _stack_depth: int = 1) -> Any:
        """The line magics a lesson may use; any other one raises, naming itself."""
        line = line.strip()
        if name == "matplotlib":
            import matplotlib

            backend = os.environ.get("MPLBACKEND", "Agg")
            matplotlib.use(backend)
            return None
        if name in _QUIET_MAGICS:
            return None
        if name == "env":
            return self._env(line)
        if name == "cd":
            os.chdir(os.path.expanduser(line or "~"))
            print(os.getcwd())
            return None
        if name == "pwd":
            return os.getcwd()
        if name == "time":
            return self._time(line, "<%time>")
        if name == "timeit":
            return self._timeit(line)
        if name in ("pip", "conda", "mamba"):
            raise RuntimeError(
                f"%{name} {line}: a lesson running as a script installs nothing; install the "
                "packages before running it"
            )
        raise RuntimeError(
            f"the line magic %{name} is not available when a lesson runs as a script; add it "
            "to scripts/kernel_shim/lesson_kernel.py or avoid it in the lesson"
        )

    def run_cell_magic(self, name: str, line: str, cell: str) -> Any:
        """The cell magics a lesson may use; any other one raises, naming itself."""
        if name == "time":
            return self._time(cell, "<%%time>")
        if name == "capture":
            return self._capture(line, cell)
        if name == "writefile":
            args = shlex.split(line)
            append = "-a" in args or "--append" in args
            path = Path([a for a in args if not a.startswith("-")][0])
            with open(path, "a" if append else "w") as f:
                f.write(cell)
            print(f"{'Appending to' if append else 'Writing'} {path}")
            return None
        if name in ("bash", "sh", "script"):
            command = cell if name != "script" else f"{line}\n{cell}"
            return self.system(command) and None
        if name in ("html", "HTML", "markdown"):
            print(_strip_tags(cell) if name != "markdown" else cell)
            return None
        raise RuntimeError(
            f"the cell magic %%{name} is not available when a lesson runs as a script; add it "
            "to scripts/kernel_shim/lesson_kernel.py or avoid it in the lesson"
        )

    def _env(self, line: str) -> Any:
        if not line:
            return dict(os.environ)
        if "=" in line:
            key, _, value = line.partition("=")
        elif " " in line:
            key, _, value = line.partition(" ")
        else:
            return os.environ.get(line)
        os.environ[key.strip()] = self.var_expand(value.strip())
        print(f"env: {key.strip()}={os.environ[key.strip()]}")
        return None

    def _run(self, source: str, filename: str) -> Any:
        """Run ``source`` in the lesson's namespace; the value of a final expression returned."""
        import ast

        tree = ast.parse(source, filename)
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, filename, "exec"), self.user_ns)
        return eval(compile(last, filename, "eval"), self.user_ns) if last else None

    def _time(self, source: str, filename: str) -> Any:
        start_wall, start_cpu = time.perf_counter(), time.process_time()
        try:
            return self._run(source, filename)
        finally:
            wall, cpu = time.perf_counter() - start_wall, time.process_time() - start_cpu
            print(f"CPU times: {cpu:.3g} s\nWall time: {wall:.3g} s")

    def _timeit(self, line: str) -> None:
        source = re.sub(r"^(-[nr]\s*\d+\s*|-q\s*|-o\s*)+", "", line)
        code = compile(source, "<%timeit>", "exec")
        exec(code, self.user_ns)  # warm-up, as timeit's calibration does
        times = []
        for _ in range(7):
            start = time.perf_counter()
            exec(code, self.user_ns)
            times.append(time.perf_counter() - start)
        times.sort()
        print(f"{times[3] * 1e6:.3g} µs median of 7 runs, 1 loop each (script shim's %timeit)")

    def _capture(self, line: str, cell: str) -> None:
        import contextlib
        import io

        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            self._run(cell, "<%%capture>")
        name = line.split()[0] if line.split() else ""
        if name and not name.startswith("-"):
            self.user_ns[name] = _Captured(out.getvalue(), err.getvalue())


class _Captured:
    """What ``%%capture name`` stores: the text, and ``show()`` to print it."""

    def __init__(self, stdout: str, stderr: str) -> None:
        self.stdout, self.stderr, self.outputs = stdout, stderr, []

    def show(self) -> None:
        sys.stdout.write(self.stdout)
        sys.stderr.write(self.stderr)

    __call__ = show


# --- IPython.display's objects --------------------------------------------------------------


class _DisplayObject:
    """HTML, Markdown, ...: ``display`` prints their text (tags stripped for HTML)."""

    mime = "text/plain"

    def __init__(
        self, data: Any = None, url: str | None = None, filename: str | None = None, **kwargs: Any
    ) -> None:
        if data is None and filename:
            data = Path(filename).read_text()
        self.data = data if data is not None else (url or "")

    @property
    def _shim_text(self) -> str:
        text = str(self.data)
        return _strip_tags(text) if self.mime == "text/html" else text

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        return {self.mime: self.data, "text/plain": self._shim_text}


class HTML(_DisplayObject):
    mime = "text/html"


class Markdown(_DisplayObject):
    mime = "text/markdown"


class Latex(_DisplayObject):
    mime = "text/latex"


class Math(Latex):
    pass


class Pretty(_DisplayObject):
    pass


class Code(_DisplayObject):
    pass


class SVG(_DisplayObject):
    mime = "image/svg+xml"

    @property
    def _shim_text(self) -> str:
        return "<SVG image>"


class Javascript(_DisplayObject):
    mime = "application/javascript"

    @property
    def _shim_text(self) -> str:
        return "<Javascript: not run in a script>"


class JSON(_DisplayObject):
    mime = "application/json"

    @property
    def _shim_text(self) -> str:
        return json.dumps(self.data, indent=1, default=repr)


class Image(_DisplayObject):
    """A PNG from bytes or a file; ``display`` saves it next to the lesson's figures."""

    def __init__(
        self, data: Any = None, url: str | None = None, filename: str | None = None, **kwargs: Any
    ) -> None:
        if data is None and filename:
            data = Path(filename).read_bytes()
        elif isinstance(data, str) and Path(data).is_file():
            data = Path(data).read_bytes()
        self.data = data if data is not None else b""
        self.url = url

    @property
    def _shim_text(self) -> str:
        return f"<Image {self.url or ''}>"

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        if isinstance(self.data, bytes) and self.data.startswith(b"\x89PNG"):
            return {"image/png": self.data, "text/plain": self._shim_text}
        return {"text/plain": self._shim_text}
