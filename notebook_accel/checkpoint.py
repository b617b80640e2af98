"""Checkpoints: `save_state`/`load_state` for a whole training run, `save_model` for weights.

A checkpoint is a directory (file names follow Accelerate's):

    model.safetensors, model_1.safetensors, ...   each prepared model's weights
    optimizer.bin, optimizer_1.bin, ...           each optimizer's state
    scheduler.bin, scheduler_1.bin, ...           each scheduler's state
    scaler.pt                                     the fp16 loss scaler
    custom_checkpoint_0.pkl, ...                  objects given to register_for_checkpointing
    random_states_{rank}.pkl                      every random generator of each rank
    loop_state_{rank}.pkl                         each rank's step counter and DataLoader positions
    checkpoint.json                               what the checkpoint holds; written last
    sharded/                                      instead of the model and optimizer files when
                                                  the models are sharded (FSDP): each rank's
                                                  shards, through torch.distributed.checkpoint

The main process writes the shared files, each rank its own. Everything is
written into a hidden directory beside the target (`.NAME.partial`); when
every rank has finished, the main process writes `checkpoint.json` and renames
the directory into place. A process killed during a save therefore leaves the
previous checkpoints as they were, and a half-written directory is never taken
for a checkpoint.

`checkpoint.json` records each file's size and CRC-32 (zlib's, computed from
the bytes on their way to the disk: see notebook_accel/checksums.py).
Loading reads and checks every file on every rank before anything is changed,
its checksum included, so a file whose bytes changed but whose size did not
is named too; if any rank finds a problem, every rank raises
`CheckpointError` and no state is overwritten. Checkpoints written before
checksums were recorded load with the size check only.

A sharded checkpoint also loads on a different number of processes (one
model or the whole weights, as each rank needs them); the random generators
and DataLoader positions are per process and are then left as they are.

What is saved is what a `TrainingObjects` registry holds (see
`notebook_accel.registry`), handed over with this process's place in a
`CheckpointContext`; nothing here knows the `Accelerator`.

The `.bin`/`.pt`/`.pkl` files are pickles: load only checkpoints you trust.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from notebook_accel import fsdp, ops
from notebook_accel.checksums import (
    ChecksummingFile,
    file_checksum,
    safetensors_checksum,
    tensor_checksums,
)
from notebook_accel.kwargs import ProjectConfiguration
from notebook_accel.nested import to_cpu
from notebook_accel.registry import TrainingObjects
from notebook_accel.seeding import rng_states, set_rng_states

FORMAT_VERSION = 1
MANIFEST = "checkpoint.json"
CHECKPOINTS_FOLDER = "checkpoints"
SAFE_WEIGHTS = "model.safetensors"
SHARDED_FOLDER = "sharded"
PICKLED_WEIGHTS = "pytorch_model.bin"
_NUMBERED = re.compile(r"checkpoint_(\d+)")

# Called with each file's path right after a save has written it. Tests set it
# to stop a process between two files of a save.
after_file_written: Callable[[Path], None] | None = None

# The checksums of files this process wrote in the current save, computed while
# each was written: path -> (size, modification time in ns, "crc32:..."). The
# manifest takes them from here, and computes the rest (other ranks' files).
_written_checksums: dict[Path, tuple[int, int, str]] = {}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing, incomplete, corrupted, or for another run."""


@dataclass(frozen=True)
class CheckpointContext:
    """What `save_state` and `load_state` work on: the run's objects and this process's place.

    Args:
        objects: what is saved and restored, in order; `load_state` sets its step.
        project: where automatically named checkpoints go; its `iteration`
            advances after each save and follows each load.
        process_index / num_processes: this process's rank and the world size.
        barrier: blocks until every process calls it (a no-op in one process).
        unwrap: a prepared model's own module (without DDP or compile wrappers).
        mixed_precision: recorded in the manifest.
        sync_gradients: False in the middle of gradient accumulation (save warns then).
    """

    objects: TrainingObjects
    project: ProjectConfiguration
    process_index: int = 0
    num_processes: int = 1
    barrier: Callable[[], None] = lambda: None
    unwrap: Callable[[torch.nn.Module], torch.nn.Module] = lambda model: model
    mixed_precision: str = "no"
    sync_gradients: bool = True

    @property
    def is_main_process(self) -> bool:
        """True on rank 0, the process that writes the shared files."""
        return self.process_index == 0

    def unwrapped_models(self) -> list[torch.nn.Module]:
        """Every model of the run, unwrapped, in order."""
        return [self.unwrap(model) for model in self.objects.models]


# -- finding checkpoints ------------------------------------------------------------


def list_checkpoints(folder: str | os.PathLike) -> list[Path]:
    """The complete `checkpoint_N` directories in `folder`, oldest (lowest N) first.

    A directory without `checkpoint.json` is not complete and is left out.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = []
    for entry in folder.iterdir():
        match = _NUMBERED.fullmatch(entry.name)
        if match and (entry / MANIFEST).is_file():
            found.append((int(match.group(1)), entry))
    return [path for _, path in sorted(found)]


def latest_checkpoint(project_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint saved with automatic naming under `project_dir`, or None."""
    found = list_checkpoints(Path(project_dir) / CHECKPOINTS_FOLDER)
    return found[-1] if found else None


# -- save_state -----------------------------------------------------------------------


def save_state(
    run: CheckpointContext, output_dir: str | os.PathLike | None, safe_serialization: bool
) -> Path:
    """Write the whole training state of every rank atomically; returns the directory."""
    target = _save_target(run, output_dir)
    partial = target.parent / f".{target.name}.partial"
    _written_checksums.clear()  # only this save's files are looked up
    if run.is_main_process:
        _finish_interrupted_swap(target)
        _fresh_directory(partial)
    run.barrier()  # the directory exists before anyone writes into it
    _warn_if_accumulating(run)
    _write_rank_files(run, partial)
    sharded = any(fsdp.is_sharded(model) for model in run.unwrapped_models())
    if sharded:  # every rank writes its own shards
        fsdp.sharded_save(partial / SHARDED_FOLDER, run.unwrapped_models(), run.objects.optimizers)
    if run.is_main_process:
        _write_shared_files(run, partial, safe_serialization, weights=not sharded)
    run.barrier()  # every rank's files are in
    if run.is_main_process:
        _write_manifest(run, partial, sharded)
        _move_into_place(partial, target)
        _rotate(run, target.parent)
    run.barrier()  # nobody goes on before the checkpoint is in place
    if run.project.automatic_checkpoint_naming:
        run.project.iteration += 1
    return target


def _save_target(run: CheckpointContext, output_dir: str | os.PathLike | None) -> Path:
    config = run.project
    if not config.automatic_checkpoint_naming:
        if output_dir is None:
            raise ValueError(
                "save_state() needs output_dir, or an Accelerator with "
                "ProjectConfiguration(project_dir=..., automatic_checkpoint_naming=True)."
            )
        target = Path(output_dir).absolute()
        _refuse_to_replace_other_files(target)
        return target
    if config.project_dir is None:
        raise ValueError(
            "automatic_checkpoint_naming=True needs ProjectConfiguration(project_dir=...)."
        )
    target = (
        Path(config.project_dir).absolute() / CHECKPOINTS_FOLDER / f"checkpoint_{config.iteration}"
    )
    if target.exists():
        raise FileExistsError(
            f"{target} already exists and is not overwritten. Call load_state() first to "
            "continue from the newest checkpoint, or set ProjectConfiguration(iteration=...) "
            "to the next free number."
        )
    return target


def _refuse_to_replace_other_files(target: Path) -> None:
    """save_state replaces its directory whole: never one that holds anything else."""
    if target.is_file() or (
        target.is_dir() and not (target / MANIFEST).exists() and any(target.iterdir())
    ):
        raise CheckpointError(
            f"{target} exists and is not a checkpoint; save_state() replaces its directory "
            "as a whole, so it would delete what is there. Give it a new or empty directory, "
            "for example a subdirectory such as checkpoints/step_100."
        )


def _finish_interrupted_swap(target: Path) -> None:
    """Put back a checkpoint a save had moved aside when it was killed mid-swap."""
    previous = target.parent / f".{target.name}.previous"
    if not target.exists() and (previous / MANIFEST).exists():
        previous.rename(target)


def _warn_if_accumulating(run: CheckpointContext) -> None:
    if not run.sync_gradients and run.is_main_process:
        warnings.warn(
            "save_state() in the middle of gradient accumulation: the gradients accumulated "
            "since the last optimizer step are not saved. Save right after an optimizer step "
            "(when accelerator.sync_gradients is True) for an exact resume.",
            stacklevel=3,
        )


def _fresh_directory(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)  # left by a save that was interrupted
    path.mkdir(parents=True)


def _write_rank_files(run: CheckpointContext, folder: Path) -> None:
    rank = run.process_index
    _write_file(folder / f"random_states_{rank}.pkl", rng_states(), torch.save)
    loop = {
        "step": run.objects.step,
        "dataloaders": [loader.state_dict() for loader in run.objects.dataloaders],
    }
    _write_file(folder / f"loop_state_{rank}.pkl", loop, torch.save)


def _write_shared_files(
    run: CheckpointContext, folder: Path, safe: bool, weights: bool = True
) -> None:
    for i, model in enumerate(run.objects.models if weights else []):
        name = _numbered(SAFE_WEIGHTS if safe else PICKLED_WEIGHTS, i)
        _write_weights(folder / name, model_tensors(run.unwrap(model)), safe)
    # States go to disk as CPU tensors: torch.save cannot write XLA tensors, and
    # load_state moves them back to each parameter's device.
    for i, optimizer in enumerate(run.objects.optimizers if weights else []):
        state = to_cpu(optimizer.state_dict())
        _write_file(folder / _numbered("optimizer.bin", i), state, torch.save)
    for i, scheduler in enumerate(run.objects.schedulers):
        state = to_cpu(scheduler.state_dict())
        _write_file(folder / _numbered("scheduler.bin", i), state, torch.save)
    if run.objects.scaler is not None:
        _write_file(folder / "scaler.pt", to_cpu(run.objects.scaler.state_dict()), torch.save)
    for i, obj in enumerate(run.objects.custom_objects):
        _write_file(folder / f"custom_checkpoint_{i}.pkl", to_cpu(obj.state_dict()), torch.save)


def _numbered(name: str, index: int) -> str:
    """Accelerate's naming: the first object's file is `name`, the next `stem_1.ext`, ..."""
    if index == 0:
        return name
    stem, ext = name.split(".", 1)
    return f"{stem}_{index}.{ext}"


def _write_manifest(run: CheckpointContext, folder: Path, sharded: bool = False) -> None:
    paths = [path for path in sorted(folder.rglob("*")) if path.is_file()]
    files = {path.relative_to(folder).as_posix(): path.stat().st_size for path in paths}
    checksums = {path.relative_to(folder).as_posix(): _saved_checksum(path) for path in paths}
    for rank in range(run.num_processes):
        for name in (f"random_states_{rank}.pkl", f"loop_state_{rank}.pkl"):
            if name not in files:
                raise RuntimeError(
                    f"rank {rank} did not write {folder / name}: every process must save "
                    "into the same directory (one machine, or a shared file system)"
                )
    manifest = {
        "format": FORMAT_VERSION,
        "world_size": run.num_processes,
        "sharded": sharded,
        "mixed_precision": run.mixed_precision,
        "iteration": run.project.iteration,
        **run.objects.counts(),  # load_state refuses a run with other objects
        "files": files,
        "checksums": checksums,
    }
    _write_file(folder / MANIFEST, manifest, _write_json)


def _move_into_place(partial: Path, target: Path) -> None:
    """Rename the finished directory to `target`, replacing an older one of that name."""
    previous = target.parent / f".{target.name}.previous"
    if previous.exists():
        shutil.rmtree(previous)
    if target.exists():
        target.rename(previous)  # a directory cannot be renamed over a non-empty one
    partial.rename(target)
    _fsync(target.parent)  # make the rename itself durable
    if previous.exists():
        shutil.rmtree(previous)


def _rotate(run: CheckpointContext, folder: Path) -> None:
    """Remove the oldest automatically named checkpoints beyond `total_limit`."""
    config = run.project
    if not config.automatic_checkpoint_naming or not config.total_limit:
        return
    found = list_checkpoints(folder)
    for old in found[: max(len(found) - config.total_limit, 0)]:
        shutil.rmtree(old)


# -- writing files ----------------------------------------------------------------------


def _write_file(path: Path, obj: Any, write: Callable[[Any, Any], None]) -> None:
    """Write `obj` to `path` with `write(obj, file)`, then flush it to disk."""
    with open(path, "wb") as file:
        summed = ChecksummingFile(file)
        try:
            write(obj, summed)
        finally:
            summed.close()
    _finish(path, summed.checksum())


def _write_json(obj: Any, file: Any) -> None:
    file.write(json.dumps(obj, indent=2).encode())


def _write_weights(path: Path, tensors: dict[str, torch.Tensor], safe: bool) -> None:
    if not safe:
        _write_file(path, tensors, torch.save)
        return
    from safetensors.torch import save_file

    # "format": "pt" is what Hugging Face loaders expect in the header.
    save_file(tensors, path, metadata={"format": "pt"})
    # safetensors holds the GIL while it writes, so a thread summing beside it
    # would wait for the end: the tensors are summed in memory while the file is
    # flushed to disk instead (fsync and zlib both release the GIL).
    with ThreadPoolExecutor(1, thread_name_prefix="notebook_accel-checksum") as pool:
        summing = pool.submit(tensor_checksums, tensors)
        _fsync(path)
        sums = summing.result()
    _finish(path, safetensors_checksum(path, sums), synced=True)


def _finish(path: Path, checksum: str | None = None, synced: bool = False) -> None:
    """Flush a written file to disk (a crash after the rename must not leave it empty),
    and keep its checksum for the manifest."""
    if not synced:
        _fsync(path)
    if checksum is not None:
        stat = path.stat()
        _written_checksums[path.absolute()] = (stat.st_size, stat.st_mtime_ns, checksum)
    if after_file_written is not None:
        after_file_written(path)


def _saved_checksum(path: Path) -> str:
    """The checksum `_finish` computed for `path`, if the file is still as it was then."""
    stat = path.stat()
    known = _written_checksums.pop(path.absolute(), None)
    if known is not None and known[:2] == (stat.st_size, stat.st_mtime_ns):
        return known[2]
    return file_checksum(path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- model weights ------------------------------------------------------------------------


def model_tensors(model: torch.nn.Module | dict) -> dict[str, torch.Tensor]:
    """`model`'s state dict as standalone CPU tensors, each shared tensor once.

    Tied weights (one tensor under several names) are kept under their first
    name only; loading restores the others through the tie. Views are copied
    so that no two saved tensors share memory (safetensors refuses that).
    """
    tensors: dict[str, torch.Tensor] = {}
    seen: set[tuple] = set()
    state = model if isinstance(model, dict) else model.state_dict()
    for name, tensor in state.items():
        key = _identity(tensor)
        if key in seen:
            continue
        seen.add(key)
        tensor = tensor.detach().cpu().contiguous()
        if tensor.untyped_storage().nbytes() != tensor.nbytes:
            tensor = tensor.clone()
        tensors[name] = tensor
    return tensors


def _identity(tensor: torch.Tensor) -> tuple:
    """What makes two state-dict entries the same tensor (a tied weight)."""
    try:
        pointer = tensor.untyped_storage().data_ptr()
    except RuntimeError:  # XLA tensors have no host memory to point at: ties are not found
        pointer = id(tensor)
    return (
        tensor.device,
        pointer,
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
    )


def _weight_problems(
    tensors: dict[str, torch.Tensor], model: torch.nn.Module, strict: bool = True
) -> list[str]:
    """How `tensors` do not fit `model` (names, shapes); empty when they do."""
    expected = model.state_dict()
    present = {_identity(expected[name]) for name in tensors if name in expected}
    problems = []
    for name, tensor in tensors.items():
        if name not in expected:
            if strict:
                problems.append(f"{name} is not in the model")
        elif tensor.shape != expected[name].shape:
            problems.append(
                f"{name} has shape {list(tensor.shape)} in the file but "
                f"{list(expected[name].shape)} in the model"
            )
    for name, tensor in expected.items():
        # A missing name is fine when it is tied to a tensor the file holds.
        if name not in tensors and strict and _identity(tensor) not in present:
            problems.append(f"{name} is missing from the file")
    return problems


def _listed(problems: list[str], shown: int = 5) -> str:
    """The first few problems, and how many more there are."""
    more = len(problems) - shown
    return "; ".join(problems[:shown]) + (f"; and {more} more" if more > 0 else "")


def _load_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    model.load_state_dict(tensors, strict=False)


# -- load_state -----------------------------------------------------------------------------


@dataclass
class _Checkpoint:
    """Everything one rank reads from a checkpoint, checked but not yet applied."""

    folder: Path
    manifest: dict
    models: list[dict[str, torch.Tensor]] = field(default_factory=list)
    optimizers: list[dict] = field(default_factory=list)
    schedulers: list[dict] = field(default_factory=list)
    scaler: dict | None = None
    custom_objects: list[Any] = field(default_factory=list)
    random_states: dict = field(default_factory=dict)
    loop: dict = field(default_factory=dict)


def load_state(run: CheckpointContext, input_dir: str | os.PathLike | None) -> Path:
    """Restore what `save_state` wrote, on every rank, or change nothing; returns the directory."""
    folder = _load_source(run, input_dir)
    checkpoint, problem = None, None
    try:
        checkpoint = _read(run, folder)
    except CheckpointError as error:
        problem = str(error)
    # Every rank must agree before any state changes: one bad file stops them all.
    problems = [p for p in ops.gather_object([problem]) if p]
    if problems:
        raise CheckpointError(problem or problems[0])
    assert checkpoint is not None
    _apply(run, checkpoint)
    _continue_numbering(run, folder)
    return folder


def _load_source(run: CheckpointContext, input_dir: str | os.PathLike | None) -> Path:
    if input_dir is not None:
        folder = Path(input_dir).absolute()
        if run.is_main_process:
            _finish_interrupted_swap(folder)
        run.barrier()
    else:
        config = run.project
        if not config.automatic_checkpoint_naming or config.project_dir is None:
            raise ValueError(
                "load_state() needs input_dir, or an Accelerator with "
                "ProjectConfiguration(project_dir=..., automatic_checkpoint_naming=True)."
            )
        # The main process chooses, so every rank loads the same one.
        newest = [latest_checkpoint(config.project_dir)]
        ops.broadcast_object_list(newest)
        if newest[0] is None:
            raise CheckpointError(
                f"no complete checkpoint in {Path(config.project_dir) / CHECKPOINTS_FOLDER}"
            )
        folder = newest[0]
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such checkpoint directory")
    return folder


def _read(run: CheckpointContext, folder: Path) -> _Checkpoint:
    manifest = _read_manifest(folder)
    _check_setup(run, folder, manifest)
    _check_files(folder, manifest["files"], manifest.get("checksums", {}))
    rank = run.process_index
    checkpoint = _Checkpoint(folder, manifest)
    sharded = manifest.get("sharded", False)  # then read by _apply, through DCP
    for i, model in enumerate([] if sharded else run.objects.models):
        checkpoint.models.append(_read_weights(folder, i, run.unwrap(model)))
    for i, optimizer in enumerate([] if sharded else run.objects.optimizers):
        path = folder / _numbered("optimizer.bin", i)
        checkpoint.optimizers.append(_check_optimizer(path, _read_pickle(path), optimizer))
    for i in range(len(run.objects.schedulers)):
        checkpoint.schedulers.append(_read_pickle(folder / _numbered("scheduler.bin", i)))
    if run.objects.scaler is not None and "scaler.pt" in manifest["files"]:
        checkpoint.scaler = _read_pickle(folder / "scaler.pt")
    for i in range(len(run.objects.custom_objects)):
        checkpoint.custom_objects.append(_read_pickle(folder / f"custom_checkpoint_{i}.pkl"))
    if manifest["world_size"] != run.num_processes:  # a sharded checkpoint
        checkpoint.loop = {"step": _read_pickle(folder / "loop_state_0.pkl")["step"]}
        return checkpoint
    checkpoint.random_states = _read_pickle(folder / f"random_states_{rank}.pkl")
    checkpoint.loop = _read_pickle(folder / f"loop_state_{rank}.pkl")
    return checkpoint


def _read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            f"{folder} is not a complete checkpoint: {MANIFEST} is missing "
            "(a save_state that did not finish, or not a checkpoint directory)"
        )
    try:
        manifest = json.loads(path.read_text())
        manifest["files"], manifest["world_size"]  # noqa: B018 (the keys must be there)
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{path} is corrupted: {error}") from None
    if manifest.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format {manifest.get('format')}, this version reads "
            f"{FORMAT_VERSION}"
        )
    return manifest


def _check_setup(run: CheckpointContext, folder: Path, manifest: dict) -> None:
    """The checkpoint was made by a run shaped like this one."""
    path = folder / MANIFEST
    if manifest["world_size"] != run.num_processes and not manifest.get("sharded"):
        raise CheckpointError(
            f"{path}: saved by {manifest['world_size']} processes, but this run has "
            f"{run.num_processes}. Resume with num_processes={manifest['world_size']}."
        )
    for kind, mine in run.objects.counts().items():
        if manifest.get(kind, 0) != mine:
            raise CheckpointError(
                f"{path}: the checkpoint holds {manifest.get(kind, 0)} {kind}, but this "
                f"Accelerator has {mine}. Prepare (or register) the same objects, in "
                "the same order, before load_state()."
            )


def _check_files(folder: Path, files: dict[str, int], checksums: dict[str, str]) -> None:
    """Every file is there, with its size and (where recorded) its checksum."""
    for name, size in files.items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing from the checkpoint")
        if path.stat().st_size != size:
            raise CheckpointError(
                f"{path} is corrupted: {path.stat().st_size} bytes, {size} when it was saved"
            )
    for name, saved in checksums.items():
        path = folder / name
        found = file_checksum(path)
        if found != saved:
            raise CheckpointError(
                f"{path} is corrupted: its checksum is {found}, {saved} when it was saved "
                "(its bytes changed since; restore it or load another checkpoint)"
            )


def _read_weights(folder: Path, index: int, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    safe = folder / _numbered(SAFE_WEIGHTS, index)
    path = safe if safe.is_file() else folder / _numbered(PICKLED_WEIGHTS, index)
    tensors = _read_tensor_file(path)
    problems = _weight_problems(tensors, model)
    if problems:
        raise CheckpointError(
            f"{path} does not fit model {index} ({type(model).__name__}): " + _listed(problems)
        )
    return tensors


def _read_tensor_file(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise CheckpointError(f"{path} is missing")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(path, device="cpu")
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # safetensors and pickle raise many kinds
        raise CheckpointError(f"{path} is corrupted or not a weights file: {error}") from None


def _read_pickle(path: Path) -> Any:
    if not path.is_file():
        raise CheckpointError(f"{path} is missing from the checkpoint")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # a truncated or damaged pickle raises many kinds
        raise CheckpointError(f"{path} is corrupted: {type(error).__name__}: {error}") from None


def _check_optimizer(path: Path, saved: Any, optimizer: Any) -> dict:
    """`saved` is a state dict for `optimizer`: same groups with the same number of parameters."""
    if not isinstance(saved, dict) or "param_groups" not in saved:
        raise CheckpointError(f"{path} does not hold an optimizer state")
    theirs = [len(group["params"]) for group in saved["param_groups"]]
    mine = [len(group["params"]) for group in optimizer.param_groups]
    if theirs != mine:
        raise CheckpointError(
            f"{path}: the saved optimizer has parameter groups of sizes {theirs}, this one "
            f"{mine}; the model or the optimizer differs from the saved run"
        )
    return saved


def _apply(run: CheckpointContext, checkpoint: _Checkpoint) -> None:
    if checkpoint.manifest.get("sharded"):
        fsdp.sharded_load(
            checkpoint.folder / SHARDED_FOLDER,
            run.unwrapped_models(),
            run.objects.optimizers,
        )
    else:
        for model, tensors in zip(run.objects.models, checkpoint.models, strict=True):
            _load_tensors(run.unwrap(model), tensors)
        for optimizer, state in zip(run.objects.optimizers, checkpoint.optimizers, strict=True):
            optimizer.load_state_dict(state)
    for scheduler, state in zip(run.objects.schedulers, checkpoint.schedulers, strict=True):
        scheduler.load_state_dict(state)
    if checkpoint.scaler is not None:
        run.objects.scaler.load_state_dict(checkpoint.scaler)
    for obj, state in zip(run.objects.custom_objects, checkpoint.custom_objects, strict=True):
        obj.load_state_dict(state)
    run.objects.step = checkpoint.loop["step"]
    if not checkpoint.random_states:  # saved by another number of processes
        if run.is_main_process:
            warnings.warn(
                f"{checkpoint.folder} was saved by {checkpoint.manifest['world_size']} "
                f"processes and loaded by {run.num_processes}: weights, optimizer "
                "and scheduler states are restored; random generators and DataLoader "
                "positions are not.",
                stacklevel=3,
            )
        return
    loaders = checkpoint.loop["dataloaders"]
    for loader, state in zip(run.objects.dataloaders, loaders, strict=True):
        loader.load_state_dict(state)
    set_rng_states(checkpoint.random_states)  # last: nothing after this may draw


def _continue_numbering(run: CheckpointContext, folder: Path) -> None:
    """After loading checkpoint_N, automatic naming saves checkpoint_N+1 next (as Accelerate)."""
    match = _NUMBERED.fullmatch(folder.name)
    if run.project.automatic_checkpoint_naming and match:
        run.project.iteration = int(match.group(1)) + 1


# -- save_model and its loader ------------------------------------------------------------------


def save_model(
    model: torch.nn.Module | dict,
    save_directory: str | os.PathLike,
    max_shard_size: int | str = "10GB",
    safe_serialization: bool = True,
) -> list[Path]:
    """Write `model`'s weights to `save_directory`, in shards of at most `max_shard_size`.

    One shard is `model.safetensors` (`pytorch_model.bin` without safe
    serialization); more are `model-00001-of-00003.safetensors`, ... with an
    index `model.safetensors.index.json` mapping each weight to its shard,
    the layout Hugging Face libraries read. Each file is written under a
    temporary name and renamed; shards of an earlier save that the new one
    does not use are removed. Returns the files written.
    """
    folder = Path(save_directory)
    folder.mkdir(parents=True, exist_ok=True)
    base = SAFE_WEIGHTS if safe_serialization else PICKLED_WEIGHTS
    shards = _shard(model_tensors(model), parse_size(max_shard_size))
    names = _shard_names(base, len(shards))
    written = []
    for name, shard in zip(names, shards, strict=True):
        written.append(_replace_file(folder / name, shard, safe_serialization))
    index = folder / f"{base}.index.json"
    if len(shards) > 1:
        weight_map = {key: name for name, shard in zip(names, shards, strict=True) for key in shard}
        total = sum(t.nbytes for shard in shards for t in shard.values())
        content = {"metadata": {"total_size": total}, "weight_map": weight_map}
        written.append(_replace_file(index, content, None))
    elif index.exists():
        index.unlink()
    _remove_stale_shards(folder, base, keep=set(names))
    return written


def parse_size(size: int | str) -> int:
    """Bytes in `size`: an int, or a string such as "10GB" (10**9) or "500MiB" (2**20 each)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(([KMGT]I?)?B)\s*", size.upper())
    if not match:
        raise ValueError(
            f"max_shard_size={size!r}; write a number of bytes or e.g. '5GB', '500MB'."
        )
    number, unit = float(match.group(1)), match.group(2)
    power = "BKMGT".index(unit[0])
    return int(number * (1024 if "I" in unit else 1000) ** power)


def _shard(tensors: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    """Split `tensors`, in order, into groups of at most `limit` bytes (a bigger tensor alone)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        if shards[-1] and size + tensor.nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.nbytes
    return shards


def _shard_names(base: str, count: int) -> list[str]:
    if count == 1:
        return [base]
    stem, ext = base.split(".", 1)
    return [f"{stem}-{i:05d}-of-{count:05d}.{ext}" for i in range(1, count + 1)]


def _replace_file(path: Path, content: Any, safe: bool | None) -> Path:
    """Write `content` beside `path`, then rename it over `path` (never a half-written file)."""
    temporary = path.with_name(f".{path.name}.partial")
    if safe is None:
        _write_file(temporary, content, _write_json)
    else:
        _write_weights(temporary, content, safe)
    os.replace(temporary, path)
    return path


def _remove_stale_shards(folder: Path, base: str, keep: set[str]) -> None:
    stem, ext = base.split(".", 1)
    pattern = re.compile(rf"{re.escape(stem)}(-\d{{5}}-of-\d{{5}})?\.{re.escape(ext)}")
    for entry in folder.iterdir():
        if pattern.fullmatch(entry.name) and entry.name not in keep:
            entry.unlink()


def load_model_weights(
    model: torch.nn.Module, directory: str | os.PathLike, strict: bool = True
) -> torch.nn.Module:
    """Read weights written by `save_model` (sharded or not) into `model`; returns `model`.

    Reads `model.safetensors` or `pytorch_model.bin`, or the shards an index
    file names. Every shard is read and checked against the model before any
    weight is changed. With `strict=False`, names that are not in both are skipped.
    """
    folder = Path(directory)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such directory")
    tensors: dict[str, torch.Tensor] = {}
    for path in _weight_files(folder):
        tensors.update(_read_tensor_file(path))
    problems = _weight_problems(tensors, model, strict=strict)
    if problems:
        raise CheckpointError(
            f"the weights in {folder} do not fit {type(model).__name__}: " + _listed(problems)
        )
    expected = model.state_dict()
    _load_tensors(model, {k: v for k, v in tensors.items() if k in expected})
    return model


def _weight_files(folder: Path) -> Iterable[Path]:
    for base in (SAFE_WEIGHTS, PICKLED_WEIGHTS):
        index = folder / f"{base}.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as error:
                raise CheckpointError(f"{index} is corrupted: {error}") from None
            return [folder / name for name in sorted(set(weight_map.values()))]
        if (folder / base).is_file():
            return [folder / base]
    raise CheckpointError(
        f"{folder} holds no model weights ({SAFE_WEIGHTS}, {PICKLED_WEIGHTS} or a sharded index)"
    )
