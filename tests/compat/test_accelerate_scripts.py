"""Accelerate's own distributed test scripts, ported by the import line, pass here.

The scripts ship inside the installed accelerate package (a dev dependency).
`accelerate_scripts.py` loads them with `from accelerate... import X` turned
into `from notebook_accel... import X` wherever notebook_accel has X, and runs
their test functions in 2 CPU workers, one launch per script.

PASSING_UNDER_ACCELERATE is what Accelerate 1.15 itself passes on this
machine, 2 CPU workers (Accelerate's notebook_launcher with
ACCELERATE_USE_CPU, one launch per function; `python
tests/compat/accelerate_scripts.py accelerate` measures it again). Left out
there: test_split_between_processes_dataset (needs `datasets`), test_noop_sync
(for one process), test_can_join_uneven_inputs (hangs on CPU), three join
tests that fail, test_mrpc (needs the network) and test_problematic_imports
(needs bitsandbytes). test_stateful_dataloader needs torchdata (a dev
dependency). test_stateful_dataloader_save_state saves each rank into a
temporary directory of its own.

NOT_PORTED are the ones that fail with notebook_accel, by design (README,
"Porting from Accelerate").
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from tests_support import dev_dependency  # noqa: E402

dev_dependency("accelerate")

import accelerate_scripts  # noqa: E402

PASSING_UNDER_ACCELERATE = {
    "test_script": [
        "process_execution_check",
        "init_state_check",
        "rng_sync_check",
        "dl_preparation_check",
        "central_dl_preparation_check",
        "custom_sampler_check",
        "check_seedable_sampler",
        "check_seedable_sampler_with_data_seed",
        "check_seedable_sampler_in_batch_sampler_shard",
        "training_check",
        "test_split_between_processes_list",
        "test_split_between_processes_nested_dict",
        "test_split_between_processes_tensor",
        "test_split_between_processes_evenly",
        "test_trigger",
        "test_reinstantiated_state",
    ],
    "test_ops": [
        "test_gather",
        "test_gather_object",
        "test_gather_non_contiguous",
        "test_broadcast",
        "test_pad_across_processes",
        "test_reduce_sum",
        "test_reduce_mean",
        "test_reduce_max",
        "test_op_checker",
        "test_copy_tensor_to_devices",
    ],
    "test_sync": [
        "test_dataloader_break",
        "test_distributed_sync",
        "test_distributed_sync_multiple_fwd",
        "test_gradient_accumulation",
        "test_gradient_accumulation_with_opt_and_scheduler",
    ],
    "test_distributed_data_loop": [
        "test_default_ensures_even_batch_sizes",
        "test_can_disable_even_batches",
        "test_join_raises_warning_for_non_ddp_distributed",
        "test_pickle_accelerator",
        "test_data_loader",
        "test_stateful_dataloader",
        "test_stateful_dataloader_save_state",
    ],
    "external_deps.test_metrics": [
        "test_torch_metrics",
        "test_gather_for_metrics_drop_last",
        "test_gather_for_metrics_with_iterable_dataset",
        "test_gather_for_metrics_with_non_tensor_objects_iterable_dataset",
    ],
    "test_notebook": [
        "test_can_initialize",
        "test_clean_cuda_fork",
        "test_static_rdzv_backend",
        "test_c10d_rdzv_backend",
        "test_fault_tolerant",
        "test_monitoring",
    ],
}

# function -> why it fails with notebook_accel (also in the README)
NOT_PORTED = {
    # asserts isinstance(loader, accelerate.data_loader.DataLoaderDispatcher):
    # here every process reads an iterable dataset and keeps its share.
    "test_gather_for_metrics_with_iterable_dataset": "iterable datasets are not dispatched",
}


def test_the_list_covers_every_function_accelerate_passes_and_all_but_one_pass():
    total = sum(len(names) for names in PASSING_UNDER_ACCELERATE.values())
    assert total == 48
    assert len(NOT_PORTED) <= 1


def _worker_names(script: str) -> list[str]:
    return [name for name in PASSING_UNDER_ACCELERATE[script] if name not in NOT_PORTED]


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "script", [script for script in PASSING_UNDER_ACCELERATE if script != "test_notebook"]
)
def test_accelerate_script_passes_in_two_cpu_workers(script, tmp_path):
    from notebook_accel import notebook_launcher

    names = _worker_names(script)
    done = notebook_launcher(
        accelerate_scripts.run_cases,
        args=(script, "notebook_accel", names, str(tmp_path)),
        num_processes=2,
        backend="cpu",
        timeout=180,
        return_all=True,
    )
    assert done == [names, names]


@pytest.mark.timeout(120)
def test_accelerate_notebook_launcher_script_passes(tmp_path, monkeypatch):
    from notebook_accel import notebook_launcher

    monkeypatch.setenv("ACCELERATE_NUM_PROCESSES", "2")
    module = accelerate_scripts.load_script("test_notebook", "notebook_accel")
    # CPU workers, as the Accelerate run had them (ACCELERATE_USE_CPU), on any machine.
    monkeypatch.setitem(
        module.__dict__, "notebook_launcher", functools.partial(notebook_launcher, backend="cpu")
    )
    monkeypatch.chdir(tmp_path)
    code = dict(accelerate_scripts.LAUNCHING_CASES["test_notebook"])
    for name in _worker_names("test_notebook"):
        exec(code[name], module.__dict__)
