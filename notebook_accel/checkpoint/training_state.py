"""Checkpoints: `save_state`/`load_state` for a whole training run, `save_model` for weights.

A checkpoint is a directory (file names follow Accelerate's):

    model.safetensors, model_1.safetensors, ...   each prepared model's weights
    optimizer.bin, optimizer_1.bin, ...           each optimizer's state
    scheduler.bin, scheduler_1.bin, ...           each scheduler's state
    scaler.pt                                     the fp16 loss scaler
    custom_checkpoint_0.pkl, ...                  objects given to register_for_checkpointing
    random_states_{rank}.pkl                      every random generator of each rank
    loop_state_{rank}.pkl                         each rank's step counter and DataLoader positions
    checkpoint.json                               the manifest, written last: every file with
                                                  its size and CRC-32, whose files these are,
                                                  and which save they belong to
    sharded/                                      instead of the model and optimizer files when
                                                  the models are sharded (FSDP): each rank's
                                                  shards, through torch.distributed.checkpoint
                                                  (sharded/rank_{rank}/ for each process when
                                                  the processes save into directories of
                                                  their own; see below)

Processes need not share a directory. Each saves into the directory it was
given (`output_dir`, or `project_dir/checkpoints/checkpoint_N`), wherever that
is: one machine's disk, a file system every machine mounts, a local disk per
machine, or a temporary directory per process.

- Each process writes its own files (random generators, loop state, its FSDP
  shards) into its own directory.
- The files every process needs (weights, optimizer, scheduler, scaler,
  registered objects) are written once per directory, by the lowest rank
  that writes into it (the directory's leader): into the main process's
  directory always, and into every directory with
  `ProjectConfiguration(save_on_each_node=True)`, Accelerate's option for
  machines without a shared file system.
- A load reads each process's own files from its own directory. A process
  whose directory lacks the shared files receives them from the main
  process (a broadcast), so a checkpoint saved without `save_on_each_node`
  still resumes on every machine, at the cost of sending the weights over
  the process group.

How a save stays atomic across directories. Every step that decides
something is a collective, so the processes decide together and none reads
another machine's disk:

1. Each process checks its target; a problem on any process raises on all
   before anything is written. The main process draws a save id all share.
2. Each process writes its own files into `.NAME.<save id>.partial`, a hidden
   directory beside its target that no earlier save used.
3. Each process lists whose files it sees there. Gathered, the lists say
   which processes share a directory: the file system answers, whatever the
   paths look like (two paths to one directory, one path on two disks).
4. The leaders write the shared files and `checkpoint.json`. Every
   directory is complete and on disk before any is committed: any problem
   raises on every process, and nothing is committed.
5. The leaders commit: the old checkpoint of that name is moved aside to
   `.NAME.previous` and the new directory renamed into place. Once every
   leader has committed (a barrier) the old ones are deleted and
   `total_limit` is applied.

A process killed before step 5 leaves every directory as it was. Killed
during step 5, some directories hold the new save (with the old one as
`.NAME.previous`) and others the old one. `load_state` therefore first
gathers which save each process's directory holds, and which it replaced,
and loads the save that every process can read (the newest such), never a
mix of two; the next save or load puts the old checkpoint back in place and
deletes the half-committed one. With automatic naming a half-committed
`checkpoint_N` is passed over the same way, and numbering goes on after it.

Loading reads and checks every file on every process before anything is
changed, its CRC-32 included (computed from the bytes on their way to the
disk: see checkpoint/checksums.py), so a file whose bytes changed but
whose size did not is named too; if any process finds a problem, every
process raises `CheckpointError` and no state is overwritten. Checkpoints
written before checksums were recorded load with the size check only.

Sharded (FSDP) models are saved in one of two layouts:

- Every process saves into one directory: torch.distributed.checkpoint (DCP)
  writes each process's shards and indexes them all in one metadata file
  (`sharded/`). Such a checkpoint also loads on a different number of
  processes (one model or the whole weights, as each rank needs them); the
  random generators and DataLoader positions are per process and are then
  left as they are.
- The processes save into directories of their own: one index of every
  shard could not be read from another disk, and DCP stores a value that
  several processes hold alike (an optimizer's `step`) in one process's
  file only. So each process writes a DCP checkpoint of its own shards
  alone into `sharded/rank_{rank}/` (its shards, an index of them, its own
  copy of those values), and loads it back by itself. It loads only on the
  same number of processes with the same sharding: another number is
  refused before anything is read, and shards other than the ones a process
  holds (other FSDP settings, a model not sharded now) when they are read,
  before anything is changed. To go to another number of processes, save
  from a run whose processes share one directory, or write the whole
  weights with `save_model`.

The file system must show a file that one process wrote to the others that
share its directory once they list the directory after a barrier (local
disks do; so do NFS, Lustre and GPFS).

What is saved is what a `TrainingObjects` registry holds (see
`notebook_accel.training.registry`), handed over with this process's place in a
`CheckpointContext`; nothing here knows the `Accelerator`.

The `.bin`/`.pt`/`.pkl` files are pickles: load only checkpoints you trust.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
import warnings
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from notebook_accel.checkpoint.checksums import (
    ChecksummingFile,
    file_checksum,
    safetensors_checksum,
    tensor_checksums,
)
from notebook_accel.config.kwargs import ProjectConfiguration
from notebook_accel.training import ddp_buckets, fsdp, ops
from notebook_accel.training.nested import to_cpu
from notebook_accel.training.registry import TrainingObjects
from notebook_accel.training.seeding import rng_states, set_rng_states

FORMAT_VERSION = 1
MANIFEST = "checkpoint.json"
CHECKPOINTS_FOLDER = "checkpoints"
SAFE_WEIGHTS = "model.safetensors"
SHARDED_FOLDER = "sharded"
PICKLED_WEIGHTS = "pytorch_model.bin"
_NUMBERED = re.compile(r"checkpoint_(\d+)")
_RANK_FILE = re.compile(r"(?:random_states|loop_state)_(\d+)\.pkl")

# Called with each file's path right after a save has written it, and with a
# save's finished directory right before it is moved into place. Tests set it
# to stop a process in the middle of a save.
after_written: Callable[[Path], None] | None = None

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
            advances after each save and follows each load. Its
            `save_on_each_node` writes the shared files into every directory.
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
    # Accelerate's state hooks: save ones get (models, weights, directory) before the
    # files are written, load ones (models, directory) before anything is restored.
    save_hooks: Sequence[Callable[..., None]] = ()
    load_hooks: Sequence[Callable[..., None]] = ()

    @property
    def is_main_process(self) -> bool:
        """True on rank 0, whose directory always gets the shared files."""
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
    """The newest complete checkpoint saved with automatic naming under `project_dir`, or None.

    It looks at this process's directory only; `load_state()` agrees with the
    other processes on the newest checkpoint that every one of them has.
    """
    found = list_checkpoints(Path(project_dir) / CHECKPOINTS_FOLDER)
    return found[-1] if found else None


# -- agreeing across processes --------------------------------------------------------


def _raise_if_any(run: CheckpointContext, problem: Exception | None) -> None:
    """Raise on every process if any process has a problem (a gather)."""
    _raise_first(problem, ops.gather_object([problem]))


def _raise_first(mine: Exception | None, everyone: list[Exception | None]) -> None:
    """Raise this process's problem, else the first process's that has one, naming it."""
    if mine is not None:
        raise mine
    for rank, error in enumerate(everyone):
        if error is not None:
            raise type(error)(f"process {rank}: {error}")


def _saved_id(folder: Path) -> str | None:
    """Which save the checkpoint in `folder` belongs to; None if there is no complete one.

    Checkpoints from before save ids were recorded (always one directory) say "".
    """
    try:
        return str(json.loads((folder / MANIFEST).read_text()).get("save", ""))
    except (OSError, ValueError, AttributeError):
        return None


def _previous(target: Path) -> Path:
    """Where a commit keeps the checkpoint it replaces until every directory has committed."""
    return target.parent / f".{target.name}.previous"


def _choose_save(saved: list[tuple[str | None, str | None]]) -> str | None:
    """The save every process can load, from each one's (checkpoint's save, previous one's).

    The one all checkpoints belong to; else, after a save killed while its
    directories were committed, one that each process has either as its
    checkpoint or as the checkpoint that one replaced. None if there is none.
    """
    current = {mine for mine, _ in saved}
    if len(current) == 1 and None not in current:
        return current.pop()
    common = set.intersection(*({mine, replaced} - {None} for mine, replaced in saved))
    main = saved[0]  # the main process's directory decides between two
    return next((save for save in main if save in common), None)


def _put_previous_back(target: Path) -> None:
    """Undo a half-committed save here: its directory goes, the one it replaced returns."""
    discarded = target.parent / f".{target.name}.discarded"
    if discarded.exists():
        shutil.rmtree(discarded)
    if target.exists():
        target.rename(discarded)
    _previous(target).rename(target)
    _fsync(target.parent)
    if discarded.exists():
        shutil.rmtree(discarded)


# -- save_state -----------------------------------------------------------------------


@dataclass(frozen=True)
class _Sharing:
    """Which processes write into this process's directory, as the save found out."""

    ranks: tuple[int, ...]  # the processes whose files are in this directory, in order
    directories: int  # how many directories the save writes into
    saved: list[tuple[str | None, str | None]]  # each process's (checkpoint's, previous') save

    def leads(self, rank: int) -> bool:
        """True for the one process that commits this directory: its lowest rank."""
        return self.ranks[0] == rank


def save_state(
    run: CheckpointContext, output_dir: str | os.PathLike | None, safe_serialization: bool
) -> Path:
    """Write the whole training state of every process atomically; returns this process's
    directory (the steps are in the module's docstring)."""
    target, save_id = _agree_on_targets(run, output_dir)
    partial = target.parent / f".{target.name}.{save_id}.partial"
    _written_checksums.clear()  # only this save's files are looked up
    _warn_if_accumulating(run)
    partial.mkdir(parents=True, exist_ok=True)
    _write_rank_files(run, partial)
    run.barrier()  # every process's own files are in before anyone looks
    sharing = _find_sharing(run, target, partial)
    leader = sharing.leads(run.process_index)
    try:
        _complete(run, target, partial, save_id, sharing, safe_serialization)
    except CheckpointError:  # raised on every process: nothing is committed anywhere
        if leader:
            shutil.rmtree(partial, ignore_errors=True)
        raise
    if leader:
        _commit(partial, target)
    run.barrier()  # every directory holds the new checkpoint
    if leader:
        shutil.rmtree(_previous(target), ignore_errors=True)
        _rotate(run, target.parent)
    run.barrier()  # nobody goes on before every old checkpoint is gone
    if run.project.automatic_checkpoint_naming:
        run.project.iteration += 1
    return target


def _complete(
    run: CheckpointContext,
    target: Path,
    partial: Path,
    save_id: str,
    sharing: _Sharing,
    safe_serialization: bool,
) -> None:
    """Write the rest of every directory of the save: shards, shared files, manifests.

    Returns once every directory is complete; a problem anywhere raises on
    every process.
    """
    leader = sharing.leads(run.process_index)
    sharded = any(
        fsdp.is_sharded(model) or fsdp.has_distributed_tensors(model)  # FSDP, or split (TP)
        for model in run.unwrapped_models()
    )
    # One directory: DCP indexes every process's shards together (they reshard on load).
    # Several: each process's shards load by themselves, from its own directory.
    per_process = sharded and sharing.directories > 1
    if leader:
        _tidy(target, partial, sharing.saved)
    weights = _run_save_hooks(run, partial, sharded)
    if per_process:
        shards = partial / _own_shards(run.process_index)
        fsdp.save_own_shards(shards, run.unwrapped_models(), run.objects.optimizers)
    elif sharded:  # every rank writes its own shards, the main process the index
        fsdp.sharded_save(partial / SHARDED_FOLDER, run.unwrapped_models(), run.objects.optimizers)
    shared = leader and (run.is_main_process or run.project.save_on_each_node)
    if shared:
        _write_shared_files(run, partial, safe_serialization, weights, sharded)
    run.barrier()  # every file of every directory is in
    problem = None
    if leader:
        try:
            _write_manifest(
                run,
                partial,
                save_id,
                sharing,
                sharded=sharded,
                shared=shared,
                shards_per_process=per_process,
            )
        except CheckpointError as error:
            problem = error
    _raise_if_any(run, problem)


def _own_shards(rank: int) -> str:
    """Where in its directory a process keeps shards that load by themselves."""
    return f"{SHARDED_FOLDER}/rank_{rank}"


def _agree_on_targets(
    run: CheckpointContext, output_dir: str | os.PathLike | None
) -> tuple[Path, str]:
    """This process's target, checked on every process first, and the save's id (the main
    process's draw)."""
    target, problem = None, None
    try:
        target = _save_target(run, output_dir)
    except (ValueError, OSError) as error:  # CheckpointError, FileExistsError, ...
        problem = error
    drawn = ops.gather_object([(problem, uuid.uuid4().hex[:12])])
    _raise_first(problem, [error for error, _ in drawn])
    assert target is not None
    return target, drawn[0][1]


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


def _warn_if_accumulating(run: CheckpointContext) -> None:
    if not run.sync_gradients and run.is_main_process:
        warnings.warn(
            "save_state() in the middle of gradient accumulation: the gradients accumulated "
            "since the last optimizer step are not saved. Save right after an optimizer step "
            "(when accelerator.sync_gradients is True) for an exact resume.",
            stacklevel=3,
        )


def _find_sharing(run: CheckpointContext, target: Path, partial: Path) -> _Sharing:
    """Which processes write into which directory: each says whose files it sees (a gather).

    Also gathers which save each directory's checkpoint (and the one it
    replaced) belongs to, for `_tidy`.
    """
    seen = tuple(
        sorted({int(m.group(1)) for m in map(_RANK_FILE.fullmatch, os.listdir(partial)) if m})
    )
    mine = (seen, _saved_id(target), _saved_id(_previous(target)))
    views = ops.gather_object([mine])
    for rank, (ranks, _, _) in enumerate(views):
        if rank not in ranks or any(views[other][0] != ranks for other in ranks):
            lists = "; ".join(f"process {r} sees {list(v[0])}" for r, v in enumerate(views))
            raise CheckpointError(
                "the processes disagree about whose files are in their save directories "
                f"({lists}): the file system did not show every process the files the "
                "others wrote (a file system shared between machines that caches directory "
                "listings). Save into a directory of each machine's own, or on a file system "
                "that shows new files at once."
            )
    return _Sharing(
        ranks=views[run.process_index][0],
        directories=len({ranks for ranks, _, _ in views}),
        saved=[(current, replaced) for _, current, replaced in views],
    )


def _tidy(target: Path, partial: Path, saved: list[tuple[str | None, str | None]]) -> None:
    """Before a leader writes: undo a half-committed save in its directory, and remove what
    interrupted saves of this name left."""
    chosen = _choose_save(saved)
    here = _saved_id(target), _saved_id(_previous(target))
    if chosen is not None and here[0] != chosen and here[1] == chosen:
        _put_previous_back(target)
    stale = re.compile(rf"\.{re.escape(target.name)}\.(\w+\.partial|partial|discarded)")
    for entry in target.parent.iterdir():
        if entry != partial and stale.fullmatch(entry.name) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)


def _write_rank_files(run: CheckpointContext, folder: Path) -> None:
    rank = run.process_index
    _write_file(folder / f"random_states_{rank}.pkl", rng_states(), torch.save)
    loop = {
        "step": run.objects.step,
        "dataloaders": [loader.state_dict() for loader in run.objects.dataloaders],
        # how each DDP model sums gradients: a resumed run sums alike (ddp_buckets.py)
        "ddp_buckets": [ddp_buckets.bucket_layout(model) for model in run.objects.models],
    }
    _write_file(folder / f"loop_state_{rank}.pkl", loop, torch.save)


def _run_save_hooks(run: CheckpointContext, folder: Path, sharded: bool) -> list[dict]:
    """Each model's state dict (none when sharded), after the save hooks saw them.

    The hooks run on every process, in the directory being saved: what they write
    there is committed (and checksummed) with the rest. A hook may change the
    tensors of a state dict, not how many there are.
    """
    weights = [] if sharded else [run.unwrap(model).state_dict() for model in run.objects.models]
    expected = len(weights)
    problem = None
    for hook in run.save_hooks:
        hook(list(run.objects.models), weights, str(folder))
    if len(weights) != expected:
        problem = CheckpointError(
            f"a save_state pre-hook left {len(weights)} of the {expected} models' weights: "
            "here every prepared model is saved and loaded by save_state/load_state. Write "
            "a model in a format of your own with save_model or your own code, and change "
            "its weights in `weights` rather than removing them."
        )
    _raise_if_any(run, problem)
    return weights


def _run_load_hooks(run: CheckpointContext, folder: Path) -> None:
    """The load hooks, on every process, before anything is restored."""
    models = list(run.objects.models)
    for hook in run.load_hooks:
        hook(models, str(folder))
    problem = None
    if len(models) != len(run.objects.models):
        problem = CheckpointError(
            f"a load_state pre-hook left {len(models)} of the {len(run.objects.models)} "
            "models: here load_state restores every prepared model it saved. Load a model "
            "of your own format after load_state instead of removing it from `models`."
        )
    _raise_if_any(run, problem)


def _write_shared_files(
    run: CheckpointContext, folder: Path, safe: bool, weights: list[dict], sharded: bool
) -> None:
    for i, state in enumerate(weights):
        name = _numbered(SAFE_WEIGHTS if safe else PICKLED_WEIGHTS, i)
        _write_weights(folder / name, model_tensors(state), safe)
    # States go to disk as CPU tensors: torch.save cannot write XLA tensors, and
    # load_state moves them back to each parameter's device.
    for i, optimizer in enumerate([] if sharded else run.objects.optimizers):
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


def _write_manifest(
    run: CheckpointContext,
    folder: Path,
    save_id: str,
    sharing: _Sharing,
    sharded: bool,
    shared: bool,
    shards_per_process: bool = False,
) -> None:
    paths = [path for path in sorted(folder.rglob("*")) if path.is_file()]
    files = {path.relative_to(folder).as_posix(): path.stat().st_size for path in paths}
    for rank in sharing.ranks:
        for name in (f"random_states_{rank}.pkl", f"loop_state_{rank}.pkl"):
            if name not in files:
                raise CheckpointError(f"process {rank} did not write {folder / name}")
    found = {int(m.group(1)) for m in map(_RANK_FILE.fullmatch, files) if m}
    if found - set(sharing.ranks):  # a directory shared that the listing did not show
        raise CheckpointError(
            f"{folder} also holds the files of processes {sorted(found - set(sharing.ranks))}, "
            "which did not see it when the save began: the file system showed one process's "
            "new files to another late. Save into a directory of each machine's own, or on a "
            "file system that shows new files at once."
        )
    checksums = {path.relative_to(folder).as_posix(): _saved_checksum(path) for path in paths}
    manifest = {
        "format": FORMAT_VERSION,
        "save": save_id,
        "world_size": run.num_processes,
        "ranks": list(sharing.ranks),
        "shared": shared,  # whether the files every process needs are here
        "sharded": sharded,
        "shards_per_process": shards_per_process,  # loads on the same world size only
        "mixed_precision": run.mixed_precision,
        "iteration": run.project.iteration,
        **run.objects.counts(),  # load_state refuses a run with other objects
        "files": files,
        "checksums": checksums,
    }
    _write_file(folder / MANIFEST, manifest, _write_json)
    for directory in [path for path in folder.rglob("*") if path.is_dir()] + [folder]:
        _fsync(directory)  # the names of every process's files, before the commit


def _commit(partial: Path, target: Path) -> None:
    """Rename the finished directory to `target`, keeping an older one of that name as
    `.NAME.previous` until every directory has committed."""
    if after_written is not None:
        after_written(partial)
    previous = _previous(target)
    if previous.exists():
        shutil.rmtree(previous)
    if target.exists():
        target.rename(previous)  # a directory cannot be renamed over a non-empty one
    partial.rename(target)
    _fsync(target.parent)  # make the renames themselves durable


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
    if after_written is not None:
        after_written(path)


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
class _Shared:
    """The files every process needs, read and checked, from the directory `folder`."""

    folder: Path
    weight_files: list[Path] = field(default_factory=list)
    models: list[dict[str, torch.Tensor]] = field(default_factory=list)
    optimizers: list[dict] = field(default_factory=list)
    schedulers: list[dict] = field(default_factory=list)
    scaler: dict | None = None
    custom_objects: list[Any] = field(default_factory=list)


@dataclass
class _Checkpoint:
    """Everything one process reads from a checkpoint, checked but not yet applied."""

    folder: Path
    manifest: dict
    shared: _Shared | None = None  # None: not in this directory (the main process sends them)
    random_states: dict = field(default_factory=dict)
    loop: dict = field(default_factory=dict)
    shards: dict | None = None  # this process's own shards, read (shards saved per process)


def load_state(run: CheckpointContext, input_dir: str | os.PathLike | None) -> Path:
    """Restore what `save_state` wrote, on every process, or change nothing; returns this
    process's directory."""
    folder, next_number = _load_source(run, input_dir)
    source, half_committed = _agree_on_save(run, folder)
    checkpoint, problem = None, None
    try:
        checkpoint = _read(run, source)
    except CheckpointError as error:
        problem = error
    # Every process must agree before any state changes: one bad file stops them all.
    answers = ops.gather_object([(problem, checkpoint is not None and checkpoint.shared is None)])
    _raise_first(problem, [error for error, _ in answers])
    assert checkpoint is not None
    if any(lacking for _, lacking in answers):
        _receive_shared(run, checkpoint)
    _run_load_hooks(run, source)
    _apply(run, checkpoint)
    if half_committed:  # put this directory's checkpoint of the loaded save back in place
        run.barrier()  # every process has read its files
        if source != folder and _leads(run, checkpoint.manifest):
            _put_previous_back(folder)
        run.barrier()
    _continue_numbering(run, folder, next_number)
    return folder


def _load_source(
    run: CheckpointContext, input_dir: str | os.PathLike | None
) -> tuple[Path, int | None]:
    """The directory to load, and with automatic naming the number the next save takes.

    With automatic naming the processes agree (a gather) on the newest
    `checkpoint_N` that every one of them holds from the same save; the next
    save takes a number after every one that any of them holds.
    """
    if input_dir is not None:
        return Path(input_dir).absolute(), None
    config = run.project
    if not config.automatic_checkpoint_naming or config.project_dir is None:
        raise ValueError(
            "load_state() needs input_dir, or an Accelerator with "
            "ProjectConfiguration(project_dir=..., automatic_checkpoint_naming=True)."
        )
    folder = Path(config.project_dir).absolute() / CHECKPOINTS_FOLDER
    mine = {int(path.name.split("_")[1]): _saved_id(path) for path in list_checkpoints(folder)}
    held = ops.gather_object([mine])
    common = [n for n, save in mine.items() if all(n in his and his[n] == save for his in held)]
    if not common:
        if not any(held):
            raise CheckpointError(f"no complete checkpoint in {folder}")
        listed = "; ".join(
            f"process {rank}: " + (", ".join(f"checkpoint_{n}" for n in sorted(his)) or "none")
            for rank, his in enumerate(held)
        )
        raise CheckpointError(
            f"no checkpoint in {folder} is complete on every process ({listed}). Each "
            "process must load what it saved in the same save_state() call."
        )
    return folder / f"checkpoint_{max(common)}", max(n for his in held for n in his) + 1


def _agree_on_save(run: CheckpointContext, folder: Path) -> tuple[Path, bool]:
    """Where this process reads the save every process can load (a gather), and whether a
    half-committed save is in the way somewhere (then loaded from `.NAME.previous` there)."""
    mine = (_saved_id(folder), _saved_id(_previous(folder)), _why_not_loadable(folder))
    views = ops.gather_object([mine])
    chosen = _choose_save([(current, replaced) for current, replaced, _ in views])
    if chosen is None:
        raise CheckpointError(_no_common_save(run, folder, views))
    source = folder if mine[0] == chosen else _previous(folder)
    return source, any(current != chosen for current, _, _ in views)


def _why_not_loadable(folder: Path) -> str | None:
    if not folder.is_dir():
        return f"{folder}: no such checkpoint directory"
    try:
        _read_manifest(folder)
    except CheckpointError as error:
        return str(error)
    return None


def _no_common_save(run: CheckpointContext, folder: Path, views: list[tuple]) -> str:
    mine = views[run.process_index]
    if mine[0] is None and mine[1] is None:
        return mine[2]
    for rank, (current, replaced, why) in enumerate(views):
        if current is None and replaced is None:
            return f"process {rank}: {why}"
    saves = ", ".join(f"process {rank}: {current}" for rank, (current, _, _) in enumerate(views))
    return (
        f"{folder} and the other processes' checkpoints do not come from one save (save "
        f"ids {saves}). Give each process the directory it saved into in one save_state() call."
    )


def _leads(run: CheckpointContext, manifest: dict) -> bool:
    """Whether this process is the lowest rank whose files are in the loaded directory."""
    return min(manifest.get("ranks") or range(manifest["world_size"])) == run.process_index


def _read(run: CheckpointContext, folder: Path) -> _Checkpoint:
    manifest = _read_manifest(folder)
    _check_setup(run, folder, manifest)
    _check_files(folder, manifest["files"], manifest.get("checksums", {}))
    checkpoint = _Checkpoint(folder, manifest)
    if manifest.get("shared", True):
        checkpoint.shared = _read_shared(run, folder, manifest)
    if manifest["world_size"] != run.num_processes:  # a sharded checkpoint
        checkpoint.loop = {"step": _read_pickle(folder / "loop_state_0.pkl")["step"]}
        return checkpoint
    rank = run.process_index
    checkpoint.random_states = _read_pickle(folder / f"random_states_{rank}.pkl")
    checkpoint.loop = _read_pickle(folder / f"loop_state_{rank}.pkl")
    if manifest.get("shards_per_process"):
        checkpoint.shards = _read_own_shards(run, folder)
    return checkpoint


def _read_own_shards(run: CheckpointContext, folder: Path) -> dict:
    """This process's shards, read into new tensors and checked against the ones it holds."""
    shards = folder / _own_shards(run.process_index)
    try:
        return fsdp.read_own_shards(shards, run.unwrapped_models(), run.objects.optimizers)
    except ValueError as error:
        raise CheckpointError(
            f"{shards} does not hold the shards this process has: {error}. Shards saved into "
            "directories of their own load only on the same number of processes with the "
            "same FSDP settings; to load otherwise, save from a run whose processes share "
            "one directory (its shards reshard on load), or write the whole weights with "
            "save_model() and read them with load_model_weights()."
        ) from None


def _read_shared(run: CheckpointContext, folder: Path, manifest: dict) -> _Shared:
    shared = _Shared(folder)
    sharded = manifest.get("sharded", False)  # then read by _apply, through DCP
    for i in range(0 if sharded else len(run.objects.models)):
        safe = folder / _numbered(SAFE_WEIGHTS, i)
        path = safe if safe.is_file() else folder / _numbered(PICKLED_WEIGHTS, i)
        shared.weight_files.append(path)
        shared.models.append(_read_tensor_file(path))
    for i in range(0 if sharded else len(run.objects.optimizers)):
        shared.optimizers.append(_read_pickle(folder / _numbered("optimizer.bin", i)))
    for i in range(len(run.objects.schedulers)):
        shared.schedulers.append(_read_pickle(folder / _numbered("scheduler.bin", i)))
    if run.objects.scaler is not None and "scaler.pt" in manifest["files"]:
        shared.scaler = _read_pickle(folder / "scaler.pt")
    for i in range(len(run.objects.custom_objects)):
        shared.custom_objects.append(_read_pickle(folder / f"custom_checkpoint_{i}.pkl"))
    _check_shared(run, shared)
    return shared


def _check_shared(run: CheckpointContext, shared: _Shared) -> None:
    """The weights and optimizer states fit this process's models and optimizers."""
    for i, (path, tensors) in enumerate(zip(shared.weight_files, shared.models, strict=True)):
        model = run.unwrap(run.objects.models[i])
        problems = _weight_problems(tensors, model)
        if problems:
            raise CheckpointError(
                f"{path} does not fit model {i} ({type(model).__name__}): " + _listed(problems)
            )
    for i, (state, optimizer) in enumerate(
        zip(shared.optimizers, run.objects.optimizers, strict=False)
    ):
        _check_optimizer(shared.folder / _numbered("optimizer.bin", i), state, optimizer)


def _receive_shared(run: CheckpointContext, checkpoint: _Checkpoint) -> None:
    """Give the processes whose directory lacks the shared files the main process's (a
    broadcast), checked here too; any problem raises on every process."""
    sent = ops.broadcast_object_list([checkpoint.shared if run.is_main_process else None])[0]
    problem = None
    if checkpoint.shared is None:
        try:
            if sent is None:
                raise CheckpointError(
                    f"{checkpoint.folder} holds this process's files but not the weights, "
                    "and neither does the main process's checkpoint"
                )
            _check_shared(run, sent)
            checkpoint.shared = sent
        except CheckpointError as error:
            problem = error
    _raise_if_any(run, problem)


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
    """The checkpoint was made by a run shaped like this one, and holds this process's files."""
    path = folder / MANIFEST
    same_world = manifest["world_size"] == run.num_processes
    if not same_world and manifest.get("shards_per_process"):
        raise CheckpointError(
            f"{path}: saved by {manifest['world_size']} processes into directories of their "
            f"own, each with its own shards of the sharded (FSDP) models, but this run has "
            f"{run.num_processes}. Such shards load only on the processes that saved them: "
            f"resume with num_processes={manifest['world_size']} and the same FSDP settings. "
            "To load on another number of processes, save from a run whose processes share "
            "one directory (its shards reshard on load), or write the whole weights with "
            "save_model() and read them with load_model_weights()."
        )
    if not same_world and not manifest.get("sharded"):
        raise CheckpointError(
            f"{path}: saved by {manifest['world_size']} processes, but this run has "
            f"{run.num_processes}. Resume with num_processes={manifest['world_size']}."
        )
    ranks = manifest.get("ranks")
    if same_world and ranks is not None and run.process_index not in ranks:
        raise CheckpointError(
            f"{folder} holds the files of processes {ranks}, not of process "
            f"{run.process_index}: give each process the directory it saved into."
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
    shared = checkpoint.shared
    assert shared is not None
    if checkpoint.shards is not None:
        fsdp.set_state(run.unwrapped_models(), run.objects.optimizers, checkpoint.shards)
    elif checkpoint.manifest.get("sharded"):
        fsdp.sharded_load(
            checkpoint.folder / SHARDED_FOLDER,
            run.unwrapped_models(),
            run.objects.optimizers,
        )
    else:
        for model, tensors in zip(run.objects.models, shared.models, strict=True):
            _load_tensors(run.unwrap(model), tensors)
        for optimizer, state in zip(run.objects.optimizers, shared.optimizers, strict=True):
            optimizer.load_state_dict(state)
    for scheduler, state in zip(run.objects.schedulers, shared.schedulers, strict=True):
        scheduler.load_state_dict(state)
    if shared.scaler is not None:
        run.objects.scaler.load_state_dict(shared.scaler)
    for obj, state in zip(run.objects.custom_objects, shared.custom_objects, strict=True):
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
    layouts = checkpoint.loop.get("ddp_buckets") or [None] * len(run.objects.models)
    for model, layout in zip(run.objects.models, layouts, strict=True):
        ddp_buckets.sum_first_step_in(model, layout)
    set_rng_states(checkpoint.random_states)  # last: nothing after this may draw


def _continue_numbering(run: CheckpointContext, folder: Path, next_number: int | None) -> None:
    """After loading checkpoint_N, automatic naming saves checkpoint_N+1 next (as Accelerate),
    or after the highest number another process holds (a save that did not complete)."""
    match = _NUMBERED.fullmatch(folder.name)
    if run.project.automatic_checkpoint_naming and match:
        run.project.iteration = next_number or int(match.group(1)) + 1


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
