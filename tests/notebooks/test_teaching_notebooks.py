"""The teaching notebooks: each runs top to bottom in a real kernel, and is committed clean.

Every notebook in notebooks/ is picked up, so a new one is tested without touching this file.
"""

from __future__ import annotations

import time
from pathlib import Path

import nbformat
import pytest
import torch
from nbclient import NotebookClient

NOTEBOOKS_DIR = Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
COLAB = (
    "https://colab.research.google.com/github/notebook-accel/notebook-accel/blob/main/notebooks/"
)

# Lines a notebook must print: proof that it showed what its text says it shows. The
# notebooks adapt to the hardware; these are what a machine without GPUs (CI, Binder) prints.
EXPECTED_WITHOUT_GPUS = {
    "01_quickstart.ipynb": [
        "No GPU found: 2 CPU worker processes",
        "epoch 5: loss",
        "trained on 2 worker(s) (cpu): accuracy",
        "on 2048 samples",
        "80 steps logged; loss",
    ],
    "02_panel.ipynb": [
        "precision chosen: ['bf16']",
        "'precision': 'bf16', 'first layer computed in': 'torch.bfloat16'",
        "status finished, precision bf16, 2 workers",
    ],
    "03_multi_gpu.ipynb": [
        "No GPU found: falling back to 2 CPU worker processes",
        "{'rank': 1, 'device': 'cpu', 'batches': 48",
        "every worker ends with the same weights: True",
        "CUDA initialised in this kernel: False",
        "accuracy before training, evaluated in the kernel on cpu: 0.",
        "the workers started with: forkserver",
        "accuracy after training on 2 worker(s): 0.9",
    ],
    "04_collectives.ipynb": [
        "rank 1: [10, 11]                     -> [0, 1, 10, 11]",
        "rank 0: [1]                          -> [1.5]",
        "rank 1: [200]                        -> [100]",
        "rank 0: [0]                          -> [0, -1]",
        "gather: 12 values; gather_for_metrics: 10 values",
        "one per sample: True",
        "rank 1 answers ['prompt 4', 'prompt 5', 'prompt 6', 'prompt 6']",
        "answers in order: True",
        "in the kernel: 1 process, ['PROMPT 0', 'PROMPT 1']",
    ],
    "05_colab_tpu.ipynb": [
        "No TPU found: falling back to 2 CPU worker processes",
        "XLA runtime initialised in this kernel: False",
        "epoch 5: loss",
        "trained on 2 device(s) (cpu): accuracy",
        "on 2048 samples",
        "finished on cpu: 20 steps logged; loss",
    ],
    "09_live_workers.ipynb": [
        "2 live workers on cpu: ranks [0, 1]",
        "'rank 0 of 2 ready on cpu'",
        "# repr on worker rank 0; the value stays there: the kernel cannot unpickle it",
        "DistributedDataParallel(\n  (module): Sequential(",
        "step 30: loss",
        "'learning rate now 0.01'",
        "lower True",
        "timed out: the call did not finish within timeout=2 s",
        "the workers kept their state, at step",
        "worker rank 1 raised ValueError: a bad batch on rank 1",
        "the workers trained on, at step",
        "checkpoint saved after step",
        "ended: it was closed",
    ],
    "06_checkpoint_resume.ipynb": [
        "resumed from checkpoint_1 after step 8, in epoch 2",
        "largest weight difference from the uninterrupted run: 0.0",
        "bit for bit the same: True",
        "worker rank 1 exited with code 9; restarting every worker",
        "restarts: 1",
        "same weights as the run that never died: True",
        "worker rank 1 exited with code 9; the other workers were stopped.",
    ],
    "07_big_models.ipynb": [
        "model: 17.1 MB in 6 shards",
        "onto ['cpu', 'disk']",
        "model bigger than the budget: True",
        "same tokens as the model in one piece: True",
        "pipelined over 2 workers, same logits as one process: True",
    ],
    "08_llm_lora.ipynb": [
        "No GPU found: 2 CPU worker processes, full precision",
        "blocks of 64 tokens",
        "M trainable (LoRA)",
        "loss went down: True",
        "rank 1 holds 0.50 of the parameters",
        "'adapter_config.json', 'adapter_model.safetensors'",
        "same predictions as the trained model: True",
        "step time on cpu x 2:",
    ],
    "10_cluster.ipynb": [
        "[rank 1] epoch 3: loss",
        "a Ray cluster of this machine alone: 1 node(s), 2 CPUs, 0 GPUs",
        "trained on 2 workers: loss",
        "the relaunch forked its workers from the same agents: True",
        "the same result: True",
        "worker rank 1 on node 127.0.0.1 (",
        "raised ValueError: rank 1 found a bad batch; the other workers were stopped.",
        "live workers on the cluster: ranks [0, 1]",
        "the model is still there: 5 parameters",
        "released the warm workers: True",
    ],
    "11_detached_runs.ipynb": [
        "[rank 1] step 39: loss",
        "the detached run's final loss: ",
        "state: stopped",
        "result() raised KeyboardInterrupt('the run was stopped')",
        "was lost: its keeper process ended before the run did; its workers were stopped.",
        "state: lost",
        "resumed from checkpoint_",
        "same weights as a run never interrupted: True",
        "train_resumable x2",
    ],
}

# Notebooks whose launch shows widgets (the live view, the panel), not only text.
SHOWS_WIDGETS = {"01_quickstart.ipynb", "02_panel.ipynb"}
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def output_text(notebook) -> str:
    """Everything the notebook printed or displayed as text."""
    parts = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            parts.append(output.get("text", ""))
            parts.append(output.get("data", {}).get("text/plain", ""))
    return "\n".join(parts)


def test_there_are_notebooks():
    assert NOTEBOOKS, f"no notebooks found in {NOTEBOOKS_DIR}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_committed_without_outputs_and_with_a_colab_link(path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"cell {index} has stale outputs"
            assert cell.execution_count is None, f"cell {index} has an execution count"
    assert "widgets" not in notebook.metadata, "stale widget state in the metadata"
    first = notebook.cells[0]
    assert first.cell_type == "markdown"
    assert COLAB + path.name in first.source


# Hang guards, not speed limits: beside a busy machine's load, 08_llm_lora's training
# cell alone took over 120 s.
@pytest.mark.timeout(480)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_runs_top_to_bottom(path, tmp_path, runs_dir):
    notebook = nbformat.read(path, as_version=4)
    # `runs_dir`: detached runs (11_detached_runs) keep their directories in tmp, not in
    # the user's ~/.local/state (the kernel and the runs' keepers inherit the variable),
    # and a keeper still running at the end is killed and fails the test.
    started = time.monotonic()
    # Raises CellExecutionError, with the cell and its traceback, if any cell fails.
    NotebookClient(
        notebook,
        timeout=400,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},  # files it writes land in tmp
        # A cell's prints as one text, as a frontend shows them: the kernel sends what a
        # print wrote in as many messages as its flushes cut it into (on a loaded machine
        # "...run:" and " 0.0" of one print came in two).
        coalesce_streams=True,
    ).execute()
    took = time.monotonic() - started
    outputs = [output for cell in notebook.cells for output in cell.get("outputs", [])]
    assert [output for output in outputs if output.output_type == "error"] == []
    if path.name in SHOWS_WIDGETS:
        assert any(WIDGET_VIEW in output.get("data", {}) for output in outputs)
    text = output_text(notebook)
    expected = [] if torch.cuda.device_count() else EXPECTED_WITHOUT_GPUS.get(path.name, [])
    for line in expected:
        assert line in text, f"{path.name} did not print {line!r}; it printed:\n{text}"
    # How long it took is shown (the slowest tests are listed at the end of every run)
    # but not held to a figure: a busy machine can double it. bench/notebooks.py
    # measures it against a trivial notebook run in the same way.
    print(f"{path.name}: {took:.1f} s")
