"""Drive a real JupyterLab in headless Chromium: start a server, open a notebook, run it,
click widgets, read their text and take screenshots.

Chromium is Debian's (`apt-get install chromium`), driven by Python playwright; the
browser playwright would download is never used.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil

REPO_ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO_ROOT / "test-artifacts"

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",  # tests may run as root, where the sandbox refuses to start
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

# Every wait below is bounded by one of these (seconds).
SERVER_START_TIMEOUT = 60
LAB_LOAD_TIMEOUT = 60
KERNEL_IDLE_TIMEOUT = 60
RUN_ALL_TIMEOUT = 120
UI_TIMEOUT = 30

# JupyterLab's news toast can cover the page; no test needs it.
DISABLED_LAB_EXTENSIONS = {"@jupyterlab/apputils-extension:announcements": True}


def find_chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def missing_browser_requirements() -> str | None:
    """Why browser tests cannot run here, or None when they can."""
    try:
        import jupyterlab  # noqa: F401
        import playwright.sync_api  # noqa: F401
    except ImportError as error:
        return f"{error.name} is not installed (pip install -e '.[dev]')"
    if find_chromium() is None:
        return "chromium is not installed (apt-get install chromium)"
    return None


# ---------------------------------------------------------------- the server


@dataclass
class LabServer:
    url: str  # ends with "/"
    token: str
    root_dir: Path
    process: subprocess.Popen
    log_path: Path
    startup_seconds: float = 0.0  # from launch to the first answer

    def api(self, path: str, method: str = "GET", timeout: float = 10) -> dict:
        request = urllib.request.Request(
            self.url + path.lstrip("/"),
            method=method,
            headers={"Authorization": f"token {self.token}"},
        )
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read()
        return json.loads(body) if body else {}

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def start_lab_server(work_dir: Path) -> LabServer:
    """Start JupyterLab on 127.0.0.1, on a port the OS picks, and wait until it answers.

    `work_dir` holds the notebook root (`root/`), Jupyter's config and runtime dirs and
    the server log, so nothing of the user's own Jupyter set-up leaks in.
    """
    root_dir, config_dir, runtime_dir = (work_dir / name for name in ("root", "config", "run"))
    for directory in (root_dir, config_dir / "labconfig", runtime_dir):
        directory.mkdir(parents=True, exist_ok=True)
    page_config = {"disabledExtensions": DISABLED_LAB_EXTENSIONS}
    (config_dir / "labconfig" / "page_config.json").write_text(json.dumps(page_config))

    token = secrets.token_hex(16)
    env = dict(
        os.environ,
        JUPYTER_TOKEN=token,
        JUPYTER_CONFIG_DIR=str(config_dir),
        JUPYTER_RUNTIME_DIR=str(runtime_dir),
    )
    command = [
        sys.executable,
        "-m",
        "jupyter",
        "lab",
        "--no-browser",
        "--ip=127.0.0.1",
        "--port=0",  # the OS picks a free port; the server writes it to its info file
        f"--ServerApp.root_dir={root_dir}",
        "--expose-app-in-browser",  # window.jupyterapp: run commands without menus
        "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        "--ServerApp.terminals_enabled=False",
    ]
    if os.geteuid() == 0:
        command.append("--allow-root")  # CI containers run as root
    log_path = work_dir / "server.log"
    with open(log_path, "wb") as log:
        # Its own session, so teardown can signal the whole group by the server's pid.
        process = subprocess.Popen(
            command,
            cwd=root_dir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = LabServer("", token, root_dir, process, log_path)
    started = time.monotonic()
    try:
        info_file = runtime_dir / f"jpserver-{process.pid}.json"
        deadline = time.monotonic() + SERVER_START_TIMEOUT
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with {process.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"jupyter lab did not answer in {SERVER_START_TIMEOUT} s")
            if not server.url and info_file.exists():
                try:
                    server.url = f"http://127.0.0.1:{json.loads(info_file.read_text())['port']}/"
                except (ValueError, KeyError):
                    pass  # written but not yet complete
            if server.url:
                try:
                    server.api("api/status", timeout=2)
                    server.startup_seconds = time.monotonic() - started
                    return server
                except OSError:
                    pass
            time.sleep(0.1)
    except BaseException as error:
        stop_lab_server(server)
        raise RuntimeError(f"{error}\n--- server log ---\n{server.log_tail()}") from error


def stop_lab_server(server: LabServer, timeout: float = 15) -> None:
    """Shut the server and its kernels down and reap them; SIGKILL what outlives `timeout`."""
    process = server.process
    # Kernels run in sessions of their own: note them now, a group signal misses them.
    try:
        family = psutil.Process(process.pid).children(recursive=True)
    except psutil.Error:
        family = []
    if process.poll() is None and server.url:
        try:
            server.api("api/shutdown", method="POST", timeout=5)  # also shuts kernels down
        except OSError:
            pass
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _signal_group(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            _signal_group(process.pid, signal.SIGKILL)
            process.wait(timeout=5)
    _, alive = psutil.wait_procs(family, timeout=5)
    for child in alive:
        try:
            child.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the group the server leads (start_new_session)
    except ProcessLookupError:
        pass


# ------------------------------------------------------------------ the browser


def launch_chromium(playwright, timeout: float = UI_TIMEOUT):
    """Debian's Chromium under playwright (sync API); the caller closes it."""
    return playwright.chromium.launch(
        executable_path=find_chromium(),
        args=CHROMIUM_FLAGS,
        headless=True,
        timeout=timeout * 1000,
    )


def new_page(browser, timeout: float = UI_TIMEOUT):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(timeout * 1000)
    page.set_default_navigation_timeout(LAB_LOAD_TIMEOUT * 1000)
    return page


# ----------------------------------------------------------------- the notebook


def write_notebook(server: LabServer, name: str, sources: list[str]) -> Path:
    """Write a notebook of code cells into the server's root dir. It names the python3
    kernel, so JupyterLab starts it without asking which kernel to use."""
    import nbformat

    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(source.strip()) for source in sources]
    notebook.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    path = server.root_dir / name
    nbformat.write(notebook, path)
    return path


# The open notebook's panel, as JupyterLab's application object sees it.
_CURRENT_NOTEBOOK = """() => {
    const widget = window.jupyterapp && window.jupyterapp.shell.currentWidget;
    return widget && widget.sessionContext && widget.content ? widget : null;
}"""


def run_notebook_in_lab(page, server: LabServer, notebook_path: str | Path) -> None:
    """Open `notebook_path` (relative to the server's root) in JupyterLab, wait for an idle
    kernel, run all cells, and wait until every cell has run and the widgets have rendered.

    Raises if a cell raised (with the notebook's error text) or a wait runs out.
    """
    path = Path(notebook_path).as_posix()
    page.goto(f"{server.url}lab/tree/{path}?token={server.token}")
    page.wait_for_function(
        f"""() => {{
            const widget = ({_CURRENT_NOTEBOOK})();
            return widget && widget.context.path === {json.dumps(path)};
        }}""",
        timeout=LAB_LOAD_TIMEOUT * 1000,
    )
    page.wait_for_function(
        f"""() => {{
            const widget = ({_CURRENT_NOTEBOOK})();
            const kernel = widget && widget.sessionContext.session
                && widget.sessionContext.session.kernel;
            return kernel && kernel.connectionStatus === "connected" && kernel.status === "idle";
        }}""",
        timeout=KERNEL_IDLE_TIMEOUT * 1000,
    )
    # The command resolves when every cell has run; false when a cell raised.
    run = page.evaluate(
        """async (timeoutMs) => {
            const ran = window.jupyterapp.commands.execute("notebook:run-all-cells");
            const late = new Promise((resolve) => setTimeout(() => resolve("timeout"), timeoutMs));
            return await Promise.race([ran, late]);
        }""",
        RUN_ALL_TIMEOUT * 1000,
    )
    if run == "timeout":
        raise TimeoutError(f"running all cells took more than {RUN_ALL_TIMEOUT} s")
    errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
    if run is False:
        raise AssertionError("a cell raised:\n" + "\n".join(errors.all_inner_texts()))
    wait_for_widgets(page)


def wait_for_widgets(page, timeout: float = UI_TIMEOUT) -> None:
    """Wait until the open notebook has widget outputs and each one has been drawn."""
    page.wait_for_function(
        f"""() => {{
            const widget = ({_CURRENT_NOTEBOOK})();
            if (!widget) return false;
            const views = widget.content.widgets.flatMap((cell) =>
                cell.model.outputs ? cell.model.outputs.toJSON() : []
            ).filter((output) => output.data
                && output.data["application/vnd.jupyter.widget-view+json"]);
            const drawn = widget.node.querySelectorAll(
                ".jp-OutputArea-output > .jupyter-widgets");
            return views.length > 0 && drawn.length >= views.length;
        }}""",
        timeout=timeout * 1000,
    )


# -------------------------------------------------------------------- widgets


def outputs(page):
    """All output areas of the notebook."""
    return page.locator(".jp-NotebookPanel:visible .jp-OutputArea")


def button(page, text: str):
    """The widget button whose text (or description) is exactly `text`."""
    return outputs(page).locator("button.jupyter-button").filter(has_text=_exactly(text))


def widget(page, description: str):
    """The widget whose description label is exactly `description` (sliders, dropdowns,
    checkboxes, text boxes...); look inside it for its <select>, <input> and so on."""
    # A checkbox shows its description in label.widget-label-basic, others in label.widget-label.
    label = page.locator("label.widget-label, label.widget-label-basic").filter(
        has_text=_exactly(description)
    )
    return outputs(page).locator(".jupyter-widgets.widget-inline-hbox").filter(has=label)


def label(page, text: str | re.Pattern):
    """Label and HTML widgets showing `text` (a substring, or a pattern); descriptions,
    which are <label> elements, are left out."""
    widgets = outputs(page).locator("div.widget-label, .widget-html, .widget-htmlmath")
    return widgets.filter(has_text=text)


def click(page, text: str) -> None:
    """Click the widget button labelled `text`; it must be on the page and enabled."""
    target = button(page, text)
    target.wait_for(state="visible")
    target.click()


def choose(page, description: str, value: str | int | bool) -> None:
    """Set the widget described by `description` as a person would: pick the option
    labelled `value` in a dropdown, type `value` into a text or number box, or tick a
    checkbox (True) / clear it (False)."""
    target = widget(page, description)
    target.wait_for(state="visible")
    if target.locator("select").count():
        target.locator("select").select_option(label=str(value))
    elif target.locator("input[type=checkbox]").count():
        target.locator("input[type=checkbox]").set_checked(bool(value))
    elif target.locator("input, textarea").count():
        box = target.locator("input, textarea").first
        box.fill(str(value))
        box.press("Enter")  # text widgets send their value on change, which Enter fires
    else:
        raise ValueError(f"no dropdown, checkbox or text box described {description!r}")


def widget_text(locator) -> str:
    """What a widget shows, whitespace trimmed."""
    return locator.inner_text().strip()


def wait_for_text(page, text: str | re.Pattern, timeout: float = UI_TIMEOUT) -> None:
    """Wait until `text` (a substring, or a pattern) shows in some output area."""
    outputs(page).filter(has_text=text).first.wait_for(state="visible", timeout=timeout * 1000)


def screenshot(page, name: str, locator=None) -> Path:
    """Save `test-artifacts/<name>.png` at the repository root: the page, or only `locator`
    (an output area, say: JupyterLab scrolls inside the notebook, not the page)."""
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    (locator or page).screenshot(path=str(path))
    return path


def _exactly(text: str) -> re.Pattern:
    return re.compile(rf"^\s*{re.escape(text)}\s*$")
