"""The live display of a launch: widgets in a notebook, text lines in a script."""

from __future__ import annotations

import sys
import time

from notebook_accel.ui import format as fmt
from notebook_accel.ui.state import RunState


def in_notebook() -> bool:
    """True inside a Jupyter kernel (JupyterLab, Notebook, VS Code, Colab)."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    shell = ipython.get_ipython()
    return shell is not None and hasattr(shell, "kernel")


def live_view(plan, force: bool = False) -> RunState | None:
    """The right live display for where the launch runs."""
    main_rank = plan.node_rank * plan.local_world_size
    if in_notebook():
        try:
            import ipywidgets  # noqa: F401
        except ImportError:
            return TextView(main_rank)
        return WidgetView(main_rank, show_always=force)
    return TextView(main_rank)


class WidgetView(RunState):
    """Shows progress, metrics and the loss curve under the running cell.

    It appears with the first progress update or metric, so a launch that
    reports neither leaves the cell as it was.
    """

    def __init__(self, main_rank: int = 0, show_always: bool = False) -> None:
        super().__init__(main_rank)
        self.show_always = show_always
        self.widgets = None

    def changed(self, final: bool) -> None:
        if self.widgets is None:
            if not (self.has_live_data or self.show_always):
                return
            from IPython.display import display

            from notebook_accel.ui.widgets import RunWidgets

            self.widgets = RunWidgets()
            display(self.widgets.box)
        self.widgets.refresh(self)


class TextView(RunState):
    """Prints a progress line every few seconds, and a summary at the end."""

    interval = 2.0

    def __init__(self, main_rank: int = 0, stream=None) -> None:
        super().__init__(main_rank)
        self.stream = stream
        self.started = time.monotonic()
        self._last_line = ""

    def changed(self, final: bool) -> None:
        if not self.has_live_data:
            return
        out = self.stream or sys.stdout
        if final:
            memory = ", ".join(
                f"rank {rank} {fmt.size(figures.get('peak_rss_bytes'))}"
                for rank, figures in sorted(self.resources.items())
            )
            out.write(
                f"[notebook_accel] {self.outcome} in "
                f"{fmt.duration(time.monotonic() - self.started)}"
                + (f" · peak memory: {memory}" if memory else "")
                + "\n"
            )
        else:
            line = self.status_line()
            if line == self._last_line:
                return
            self._last_line = line
            out.write(f"[notebook_accel] {line}\n")
        out.flush()

    def status_line(self) -> str:
        parts = []
        if self.progress:
            parts.append(
                fmt.progress_line(
                    self.progress["step"], self.progress.get("total"), self.progress["elapsed"]
                )
            )
        parts += [f"{name} {fmt.number(value)}" for name, value in self.latest.items()]
        return " · ".join(parts)
