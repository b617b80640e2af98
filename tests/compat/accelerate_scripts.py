"""Run Accelerate's own distributed test scripts against notebook_accel.

Accelerate ships its distributed test scripts inside the package
(`accelerate/test_utils/scripts/`). This module loads one of them from the
installed package, optionally with its imports rewritten so that every name
notebook_accel provides comes from notebook_accel (the one-line port a user
makes), and runs named test functions of it in the current process.

Names notebook_accel does not provide (Accelerate's test fixtures such as
`RegressionModel`) keep coming from Accelerate.

Measure both sides (one launch per function, so one failure cannot hide
another):

    python tests/compat/accelerate_scripts.py accelerate
    python tests/compat/accelerate_scripts.py notebook_accel
"""

from __future__ import annotations

import ast
import importlib
import os
import sys
import types
from pathlib import Path

# script -> [(function, the code that calls it as the script's main() would, 2 processes)]
CASES: dict[str, list[tuple[str, str]]] = {
    "test_script": [
        ("process_execution_check", "process_execution_check()"),
        ("init_state_check", "init_state_check()"),
        ("rng_sync_check", "rng_sync_check()"),
        ("dl_preparation_check", "dl_preparation_check()"),
        ("central_dl_preparation_check", "central_dl_preparation_check()"),
        ("custom_sampler_check", "custom_sampler_check()"),
        ("check_seedable_sampler", "check_seedable_sampler()"),
        ("check_seedable_sampler_with_data_seed", "check_seedable_sampler_with_data_seed()"),
        (
            "check_seedable_sampler_in_batch_sampler_shard",
            "check_seedable_sampler_in_batch_sampler_shard()",
        ),
        ("training_check", "training_check(False); training_check(True)"),
        ("test_split_between_processes_list", "test_split_between_processes_list()"),
        ("test_split_between_processes_nested_dict", "test_split_between_processes_nested_dict()"),
        ("test_split_between_processes_tensor", "test_split_between_processes_tensor()"),
        ("test_split_between_processes_evenly", "test_split_between_processes_evenly()"),
        (
            "test_split_between_processes_dataset",
            "from datasets import Dataset as D; test_split_between_processes_dataset(D)",
        ),
        ("test_trigger", "test_trigger()"),
        ("test_reinstantiated_state", "test_reinstantiated_state()"),
    ],
    "test_ops": [
        (name, f"{name}(PartialState())")
        for name in (
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
        )
    ],
    "test_sync": [
        ("test_dataloader_break", "test_dataloader_break()"),
        ("test_noop_sync", "test_noop_sync(Accelerator())"),
        ("test_distributed_sync", "test_distributed_sync(Accelerator())"),
        ("test_distributed_sync_multiple_fwd", "test_distributed_sync_multiple_fwd(Accelerator())"),
        (
            "test_gradient_accumulation",
            "for s in (True, False):\n"
            " for d in (True, False):\n"
            "  for e in (True, False):\n"
            "   test_gradient_accumulation(s, d, e)",
        ),
        (
            "test_gradient_accumulation_with_opt_and_scheduler",
            "for s in (True, False):\n"
            " for d in (True, False):\n"
            "  for e in (True, False):\n"
            "   test_gradient_accumulation_with_opt_and_scheduler(s, d, e)",
        ),
    ],
    "test_distributed_data_loop": [
        ("test_default_ensures_even_batch_sizes", "test_default_ensures_even_batch_sizes()"),
        ("test_can_disable_even_batches", "test_can_disable_even_batches()"),
        ("test_can_join_uneven_inputs", "test_can_join_uneven_inputs()"),
        ("test_join_can_override_even_batches", "test_join_can_override_even_batches()"),
        (
            "test_join_can_override_for_mixed_type_dataloaders",
            "test_join_can_override_for_mixed_type_dataloaders()",
        ),
        (
            "test_join_raises_warning_for_iterable_when_overriding_even_batches",
            "test_join_raises_warning_for_iterable_when_overriding_even_batches()",
        ),
        (
            "test_join_raises_warning_for_non_ddp_distributed",
            "a = create_accelerator()\n"
            "a.state.distributed_type = DistributedType.FSDP\n"
            "test_join_raises_warning_for_non_ddp_distributed(a)",
        ),
        ("test_pickle_accelerator", "test_pickle_accelerator()"),
        (
            "test_data_loader",
            "a = create_accelerator()\n"
            "d = DummyDataset()\n"
            "for lo in (\n"
            " DataLoader(d, shuffle=False, batch_size=BATCH_SIZE, num_workers=NUM_WORKERS),\n"
            " DataLoader(d, shuffle=True, batch_size=BATCH_SIZE, num_workers=NUM_WORKERS),\n"
            " DataLoader(d, batch_sampler=BatchSampler(RandomSampler(d), batch_size=BATCH_SIZE,"
            " drop_last=False), num_workers=NUM_WORKERS),\n"
            " DataLoader(d, sampler=BatchSampler(RandomSampler(d), batch_size=BATCH_SIZE,"
            " drop_last=False), batch_size=None, collate_fn=default_collate,"
            " num_workers=NUM_WORKERS),\n"
            "):\n"
            " test_data_loader(lo, a)",
        ),
        ("test_stateful_dataloader", "test_stateful_dataloader(create_accelerator())"),
        (
            "test_stateful_dataloader_save_state",
            "test_stateful_dataloader_save_state(create_accelerator())",
        ),
    ],
    "external_deps.test_metrics": [
        (
            "test_torch_metrics",
            "for s in (True, False):\n"
            " for d in (True, False):\n"
            "  test_torch_metrics(Accelerator(dataloader_config=DataLoaderConfiguration("
            "split_batches=s, dispatch_batches=d)), 99)\n"
            "test_torch_metrics(Accelerator(), 512)",
        ),
        ("test_gather_for_metrics_drop_last", "test_gather_for_metrics_drop_last()"),
        (
            "test_gather_for_metrics_with_iterable_dataset",
            "test_gather_for_metrics_with_iterable_dataset()",
        ),
        (
            "test_gather_for_metrics_with_non_tensor_objects_iterable_dataset",
            "test_gather_for_metrics_with_non_tensor_objects_iterable_dataset()",
        ),
        ("test_mrpc", "test_mrpc()"),
    ],
}

# What each script's main() does before its first test function, run once per launch.
PRELUDE = {
    "test_script": "Accelerator()",
    "test_sync": "Accelerator()",
    "test_distributed_data_loop": "torch.manual_seed(create_accelerator().process_index)",
    "external_deps.test_metrics": "Accelerator(dataloader_config=DataLoaderConfiguration("
    "split_batches=False, dispatch_batches=False))",
    "test_ops": "PartialState()",
}

# These call notebook_launcher themselves: the kernel runs them, not a worker.
LAUNCHING_CASES: dict[str, list[tuple[str, str]]] = {
    "test_notebook": [
        ("test_can_initialize", "test_can_initialize()"),
        ("test_clean_cuda_fork", "test_clean_cuda_fork()"),
        ("test_static_rdzv_backend", "test_static_rdzv_backend()"),
        ("test_c10d_rdzv_backend", "test_c10d_rdzv_backend()"),
        ("test_fault_tolerant", "test_fault_tolerant()"),
        ("test_monitoring", "test_monitoring()"),
        ("test_problematic_imports", "test_problematic_imports()"),
    ],
}

# accelerate module -> where notebook_accel may define the same names, in order
_OURS_FOR = {
    "accelerate": ("notebook_accel", "notebook_accel.utils"),
    "accelerate.accelerator": ("notebook_accel", "notebook_accel.utils"),
    "accelerate.state": ("notebook_accel", "notebook_accel.utils"),
    "accelerate.data_loader": ("notebook_accel", "notebook_accel.utils"),
    "accelerate.launchers": ("notebook_accel",),
    "accelerate.utils": ("notebook_accel.utils", "notebook_accel"),
}


def _same_on_every_process(tensor):
    """`accelerate.test_utils.are_the_same_tensors` on our API: that helper reads
    Accelerate's own AcceleratorState, which only Accelerate's Accelerator sets up."""
    import torch

    from notebook_accel import AcceleratorState
    from notebook_accel.utils import gather

    tensor = tensor[None].clone().to(AcceleratorState().device)
    return all(torch.equal(row, tensor[0].cpu()) for row in gather(tensor).cpu())


# Test helpers of Accelerate that work only with Accelerate's own state, and ours.
FIXTURES = {"are_the_same_tensors": _same_on_every_process}


def scripts_dir() -> Path:
    """Where the installed accelerate keeps its test scripts."""
    import accelerate

    return Path(accelerate.__file__).parent / "test_utils" / "scripts"


def _our_module_for(name: str, accelerate_module: str) -> str | None:
    if accelerate_module.startswith("accelerate.utils."):
        accelerate_module = "accelerate.utils"
    for candidate in _OURS_FOR.get(accelerate_module, ()):
        module = importlib.import_module(candidate)
        if name in getattr(module, "__all__", ()) and hasattr(module, name):
            return candidate
    return None


class _Porter(ast.NodeTransformer):
    """`from accelerate... import X` -> `from notebook_accel... import X` where we have X."""

    def __init__(self) -> None:
        self.ported: list[str] = []
        self.kept: list[str] = []

    def visit_ImportFrom(self, node: ast.ImportFrom) -> ast.AST | list[ast.AST]:
        module = node.module or ""
        if node.level or not (module == "accelerate" or module.startswith("accelerate.")):
            return node
        groups: dict[str, list[ast.alias]] = {}
        for alias in node.names:
            ours = _our_module_for(alias.name, module)
            groups.setdefault(ours or module, []).append(alias)
            (self.ported if ours else self.kept).append(f"{module}.{alias.name}")
        return [
            ast.copy_location(ast.ImportFrom(module=target, names=names, level=0), node)
            for target, names in groups.items()
        ]


def _missing_external_deps() -> dict[str, types.ModuleType]:
    """Empty stand-ins for the libraries test_metrics imports at the top for its network
    test (test_mrpc) only; the script's other functions run without them."""
    stubs = {}
    for name in ("datasets", "evaluate", "transformers"):
        try:
            importlib.import_module(name)
        except ImportError:
            stub = types.ModuleType(name)
            stub.load_dataset = stub.AutoModelForSequenceClassification = None
            stub.AutoTokenizer = None
            stubs[name] = stub
    return stubs


def load_script(script: str, target: str) -> types.ModuleType:
    """Accelerate's `script` as a module; `target="notebook_accel"` ports its imports."""
    path = scripts_dir() / (script.replace(".", "/") + ".py")
    tree = ast.parse(path.read_text(), filename=str(path))
    if target == "notebook_accel":
        tree = ast.fix_missing_locations(_Porter().visit(tree))
    stubs = _missing_external_deps() if script.startswith("external_deps.") else {}
    os.environ.setdefault("ACCELERATE_NUM_PROCESSES", "2")
    module = types.ModuleType(f"ported_{script.replace('.', '_')}_{target}")
    module.__file__ = str(path)
    sys.modules[module.__name__] = module  # pickling classes defined in the script
    # The stand-ins are seen by the script's own imports only: other code asking
    # whether `datasets` is installed must still hear no.
    sys.modules.update(stubs)
    try:
        exec(compile(tree, str(path), "exec"), module.__dict__)
    finally:
        for name in stubs:
            sys.modules.pop(name, None)
    if target == "notebook_accel":
        module.__dict__.update({k: v for k, v in FIXTURES.items() if k in module.__dict__})
    return module


def ported_names(script: str) -> tuple[list[str], list[str]]:
    """(names taken from notebook_accel, names still from accelerate) for one script."""
    path = scripts_dir() / (script.replace(".", "/") + ".py")
    porter = _Porter()
    porter.visit(ast.parse(path.read_text()))
    return porter.ported, porter.kept


def run_cases(script: str, target: str, names: list[str], workdir: str) -> list[str]:
    """Run the named functions of `script` in order here; raise on the first failure."""
    os.chdir(workdir)  # some functions write files in the working directory
    module = load_script(script, target)
    code = dict(CASES.get(script, []) + LAUNCHING_CASES.get(script, []))
    if script in PRELUDE:
        exec(PRELUDE[script], module.__dict__)
    done = []
    for name in names:
        try:
            exec(code[name], module.__dict__)
        except BaseException as error:
            raise AssertionError(f"{script}.{name} failed: {error!r}") from error
        done.append(name)
    return done


def _case_in_worker(script: str, target: str, name: str, workdir: str, out: str) -> None:
    import traceback

    rank = os.environ.get("RANK", "0")
    if target == "accelerate":
        # what `accelerate launch --cpu` sets: without it Accelerate's workers on a
        # machine without GPUs each run a world of one
        os.environ["ACCELERATE_USE_CPU"] = "true"
    try:
        run_cases(script, target, [name], workdir)
        verdict = "pass"
    except BaseException as error:
        cause = error.__cause__ or error
        where = traceback.extract_tb(cause.__traceback__)[-1]
        verdict = f"FAIL {cause!r} at {Path(where.filename).name}:{where.lineno}"
    Path(out, f"{script}.{name}.{rank}").write_text(verdict)


def measure(target: str, only: list[str] | None = None) -> dict[str, str]:
    """Every case in its own 2-process launch of `target`'s notebook_launcher."""
    import tempfile

    if target == "accelerate":
        from accelerate import notebook_launcher

        os.environ["ACCELERATE_USE_CPU"] = "true"
    else:
        from notebook_accel import notebook_launcher
    verdicts = {}
    with tempfile.TemporaryDirectory() as out:
        for script, cases in CASES.items():
            for name, _ in cases:
                if only and not any(word in f"{script}.{name}" for word in only):
                    continue
                options = {} if target == "accelerate" else {"backend": "cpu", "timeout": 120}
                try:
                    notebook_launcher(
                        _case_in_worker,
                        (script, target, name, out, out),
                        num_processes=2,
                        **options,
                    )
                except BaseException as error:  # the per-rank files say more
                    print(f"launch of {name} raised {type(error).__name__}", file=sys.stderr)
                ranks = [Path(out, f"{script}.{name}.{r}") for r in (0, 1)]
                texts = [p.read_text() if p.exists() else "FAIL no result" for p in ranks]
                bad = [t for t in texts if t != "pass"]
                verdicts[f"{script}.{name}"] = bad[0] if bad else "pass"
                print(f"{script}.{name}: {verdicts[f'{script}.{name}'][:300]}", flush=True)
        for script, cases in LAUNCHING_CASES.items():
            for name, _ in cases:
                if only and not any(word in f"{script}.{name}" for word in only):
                    continue
                try:
                    run_cases(script, target, [name], out)
                    verdict = "pass"
                except BaseException as error:
                    verdict = f"FAIL {error!r}"[:300]
                verdicts[f"{script}.{name}"] = verdict
                print(f"{script}.{name}: {verdict}", flush=True)
    return verdicts


if __name__ == "__main__":
    results = measure(sys.argv[1], sys.argv[2:])
    passed = [name for name, verdict in results.items() if verdict == "pass"]
    print(f"\n{len(passed)} of {len(results)} pass under {sys.argv[1]}")
    for name in passed:
        print(f'    "{name}",')
