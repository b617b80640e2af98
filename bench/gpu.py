"""Training speed on one GPU: hand-written torch, notebook_accel and Accelerate.

Three models (those of the issue that asked for this table):
  lm    an 8-layer transformer LM (width 1024, 16 heads, 16 x 256 tokens, vocabulary
        8192), AdamW, batches from a DataLoader
  mlp   a small MLP (3 layers of 512, batch 64), AdamW, from a DataLoader: overhead-bound
  wide  4 linear layers of 8192 x 8192 on 8192 tokens (one batch kept on the GPU), AdamW
Loops: hand-written torch (a pinned DataLoader and non-blocking copies; also pageable
memory with blocking copies), notebook_accel's Accelerator and Accelerate's (when
installed), in no/fp16/bf16/fp8 as the GPU allows, eager and compiled with inductor.
Every loop starts from the same initial weights and reads the same data; the loops
take turns over `--rounds` rounds in one process and the medians count. Ratios
are against the hand-written loop of the same run; fp8 rows are also compared with
their own loop in bf16. Peak GPU memory is measured per loop. Before anything
touches CUDA here, the time from a launch call to the first optimizer step of a
forked worker is measured, twice (the second launch is warm).

    python bench/gpu.py [--rounds 3] [--budget 240] [--json bench-gpu.json]
    python bench/gpu.py --dry-run     # tiny models on the CPU: checks the script only

It prints a markdown table (the README's GPU table comes from it) and writes
the figures as JSON. A second table holds the ratios held to >= 0.98x (lm bf16 and
fp16, mlp fp32) measured in paired blocks: the prepared and the hand-written loop
alternate blocks of a few steps, so host drift moves both alike; the hand-written
loop against a copy of itself gives the noise floor (`--pairs`, 0 for none).
`--budget` bounds the rounds in seconds: they stop early (and say so) when the
next one would not fit; the paired blocks take about 30 s more.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

# Sets the NVML-based CUDA check before this script asks whether a GPU is there:
# the launch measured first forks a worker, which needs CUDA untouched here.
import notebook_accel  # noqa: F401

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Sizes:
    """The three models' sizes and how many steps each loop warms up and times."""

    lm_width: int = 1024
    lm_layers: int = 8
    lm_heads: int = 16
    lm_tokens: int = 256
    lm_batch: int = 16
    vocabulary: int = 8192
    mlp_width: int = 512
    mlp_batch: int = 64
    wide_width: int = 8192
    wide_tokens: int = 8192
    wide_layers: int = 4
    warmup: dict = field(default_factory=lambda: {"lm": 5, "mlp": 20, "wide": 3})
    steps: dict = field(default_factory=lambda: {"lm": 30, "mlp": 300, "wide": 20})


TINY = Sizes(
    lm_width=64,
    lm_layers=2,
    lm_heads=4,
    lm_tokens=16,
    lm_batch=4,
    vocabulary=128,
    mlp_width=32,
    mlp_batch=8,
    wide_width=64,
    wide_tokens=32,
    wide_layers=2,
    warmup={"lm": 1, "mlp": 1, "wide": 1},
    steps={"lm": 2, "mlp": 3, "wide": 2},
)


# -- the models -------------------------------------------------------------------


class Block(torch.nn.Module):
    """A pre-norm transformer block: causal self-attention, then a 4x MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.norm2 = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, tokens, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, tokens, width))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class LanguageModel(torch.nn.Module):
    def __init__(self, sizes: Sizes) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(sizes.vocabulary, sizes.lm_width)
        self.blocks = torch.nn.Sequential(
            *(Block(sizes.lm_width, sizes.lm_heads) for _ in range(sizes.lm_layers))
        )
        self.norm = torch.nn.LayerNorm(sizes.lm_width)
        self.head = torch.nn.Linear(sizes.lm_width, sizes.vocabulary)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(tokens))))


def build(model: str, sizes: Sizes, device: torch.device) -> torch.nn.Module:
    """The model, made on the device with the same initial weights every time."""
    torch.manual_seed(0)
    with device:
        if model == "lm":
            return LanguageModel(sizes)
        if model == "mlp":
            width = sizes.mlp_width
            return torch.nn.Sequential(
                torch.nn.Linear(width, width),
                torch.nn.ReLU(),
                torch.nn.Linear(width, width),
                torch.nn.ReLU(),
                torch.nn.Linear(width, 10),
            )
        width = sizes.wide_width
        return torch.nn.Sequential(
            *(torch.nn.Linear(width, width) for _ in range(sizes.wide_layers))
        )


def dataset(model: str, sizes: Sizes, batches: int) -> TensorDataset:
    """`batches` batches of the model's data, on the CPU, the same every time."""
    generator = torch.Generator().manual_seed(1)
    if model == "lm":
        n = batches * sizes.lm_batch
        tokens = torch.randint(sizes.vocabulary, (n, sizes.lm_tokens + 1), generator=generator)
        return TensorDataset(tokens[:, :-1].clone(), tokens[:, 1:].clone())
    n = batches * sizes.mlp_batch
    return TensorDataset(
        torch.randn(n, sizes.mlp_width, generator=generator),
        torch.randint(10, (n,), generator=generator),
    )


def batch_size(model: str, sizes: Sizes) -> int:
    return sizes.lm_batch if model == "lm" else sizes.mlp_batch


def loss_of(output: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
    if target is None:  # the wide MLP: any scalar that reaches every weight
        return output.float().square().mean()
    return F.cross_entropy(output.flatten(0, -2).float(), target.flatten())


def wide_batch(sizes: Sizes, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(sizes.wide_tokens, sizes.wide_width, generator=generator).to(device)


# -- the loops: each yields after every optimizer step ------------------------------


@dataclass(frozen=True)
class Variant:
    """One row of the table: a model trained by one loop in one precision."""

    model: str
    loop: str  # "hand-written", "notebook_accel" or "accelerate"
    precision: str = "bf16"
    compiled: bool = False
    pinned: bool = True  # hand-written: pinned memory and non-blocking copies
    non_blocking: bool | None = None  # DataLoaderConfiguration(non_blocking=...)

    @property
    def label(self) -> str:
        label = self.loop
        if not self.pinned:
            label += ", pageable + blocking"
        if self.non_blocking is not None:
            label += f", non_blocking={self.non_blocking}"
        return label


@dataclass
class Run:
    """What one loop built: its steps, and the model to count float8 layers in."""

    steps: Iterator[None]
    model: torch.nn.Module
    close: Callable[[], None] = lambda: None


def hand_written(variant: Variant, sizes: Sizes, device: torch.device, batches: int) -> Run:
    model = build(variant.model, sizes, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler(device.type) if variant.precision == "fp16" else None
    dtype = DTYPES.get(variant.precision)
    compiled = torch.compile(model) if variant.compiled else model

    def step(x: torch.Tensor, y: torch.Tensor | None) -> None:
        context = torch.autocast(device.type, dtype) if dtype else contextlib.nullcontext()
        with context:
            loss = loss_of(compiled(x), y)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad(set_to_none=True)

    def steps() -> Iterator[None]:
        if variant.model == "wide":
            x = wide_batch(sizes, device)
            for _ in range(batches):
                step(x, None)
                yield
            return
        pin = variant.pinned and device.type == "cuda"
        loader = DataLoader(
            dataset(variant.model, sizes, batches),
            batch_size=batch_size(variant.model, sizes),
            pin_memory=pin,
        )
        for x, y in loader:
            step(x.to(device, non_blocking=pin), y.to(device, non_blocking=pin))
            yield

    return Run(steps(), model)


def accelerated(variant: Variant, sizes: Sizes, device: torch.device, batches: int) -> Run:
    """notebook_accel's or Accelerate's Accelerator: the same code, another import."""
    if variant.loop == "accelerate":
        import accelerate
        from accelerate.state import AcceleratorState, GradientState
        from accelerate.utils import DataLoaderConfiguration

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        accelerator_class = accelerate.Accelerator
    else:
        from notebook_accel import Accelerator as accelerator_class
        from notebook_accel import DataLoaderConfiguration
    options: dict[str, Any] = {"mixed_precision": variant.precision, "cpu": device.type == "cpu"}
    if variant.compiled:
        options["dynamo_backend"] = "inductor"
    if variant.non_blocking is not None:
        options["dataloader_config"] = DataLoaderConfiguration(non_blocking=variant.non_blocking)
    accelerator = accelerator_class(**options)
    model = build(variant.model, sizes, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if variant.model == "wide":
        model, optimizer = accelerator.prepare(model, optimizer)
        x = wide_batch(sizes, device)
        data: Any = [(x, None)] * batches
    else:
        loader = DataLoader(
            dataset(variant.model, sizes, batches), batch_size=batch_size(variant.model, sizes)
        )
        model, optimizer, data = accelerator.prepare(model, optimizer, loader)

    def steps() -> Iterator[None]:
        for x, y in data:
            accelerator.backward(loss_of(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            yield

    return Run(steps(), accelerator.unwrap_model(model), accelerator.free_memory)


LOOPS = {"hand-written": hand_written, "notebook_accel": accelerated, "accelerate": accelerated}


def variants() -> list[Variant]:
    """Every row of the table, in the order the loops take turns."""
    rows = [Variant("lm", "hand-written", precision) for precision in ("no", "fp16", "bf16")]
    rows.append(Variant("lm", "hand-written", "bf16", pinned=False))
    rows += [Variant("lm", "notebook_accel", p) for p in ("no", "fp16", "bf16", "fp8")]
    rows.append(Variant("lm", "notebook_accel", "bf16", non_blocking=False))
    rows += [
        Variant("lm", "accelerate", "bf16"),
        Variant("lm", "accelerate", "bf16", non_blocking=True),
        Variant("lm", "accelerate", "fp8"),
    ]
    rows += [Variant("mlp", loop, "no") for loop in LOOPS]
    rows += [
        Variant("wide", "hand-written", "bf16"),
        Variant("wide", "notebook_accel", "bf16"),
        Variant("wide", "notebook_accel", "fp8"),
        Variant("wide", "notebook_accel", "bf16", compiled=True),
        Variant("wide", "notebook_accel", "fp8", compiled=True),
        Variant("wide", "accelerate", "bf16"),
        Variant("wide", "accelerate", "fp8"),
    ]
    return rows


# -- what this machine can run -------------------------------------------------------


def why_not(variant: Variant, device: torch.device, dry_run: bool) -> str | None:
    """Why `variant` cannot run here, or None."""
    if variant.loop == "accelerate" and importlib.util.find_spec("accelerate") is None:
        return "accelerate is not installed"
    if dry_run and variant.compiled:
        return "dry run: nothing is compiled"
    if variant.precision == "fp8":
        if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
            return "fp8 needs a GPU of compute capability 8.9 or newer"
        if importlib.util.find_spec("torchao") is None:
            return "fp8 needs torchao (pip install torchao)"
    if variant.precision == "bf16" and device.type == "cuda":
        if torch.cuda.get_device_capability(device) < (8, 0):
            return "bf16 needs compute capability 8.0"
    return None


def float8_count(model: torch.nn.Module) -> str:
    """Float8 layers out of all Linear layers ("2/4"); torchao's class is found by name."""
    linear = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    float8 = [m for m in linear if any(c.__name__ == "Float8Linear" for c in type(m).__mro__)]
    return f"{len(float8)}/{len(linear)}"


# -- measuring -----------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(variant: Variant, sizes: Sizes, device: torch.device) -> dict:
    """Build the loop, warm it up, time its steps: steps/s, peak memory, float8 layers."""
    warmup, steps = sizes.warmup[variant.model], sizes.steps[variant.model]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    began = time.perf_counter()
    run = LOOPS[variant.loop](variant, sizes, device, warmup + steps)
    try:
        warming = time.perf_counter()
        for _ in range(warmup):  # compiling happens here
            next(run.steps)
        synchronize(device)
        started = time.perf_counter()
        for _ in range(steps):
            next(run.steps)
        synchronize(device)
        seconds = time.perf_counter() - started
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        return {
            "steps_per_s": steps / seconds,
            "peak_mib": peak / 2**20,
            "float8": float8_count(run.model),
            # what this loop will take in a later round, when nothing compiles any more
            "next_round_s": (warming - began) + seconds * (1 + warmup / steps),
        }
    finally:
        run.close()
        del run
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def measure_rounds(
    rows: list[Variant], sizes: Sizes, device: torch.device, rounds: int, budget: float, dry: bool
) -> tuple[dict[Variant, dict], int]:
    """Every runnable row once per round, in turn; stops early when the budget is spent."""
    results: dict[Variant, dict] = {v: {"rates": [], "peaks": []} for v in rows}
    for variant in rows:
        results[variant]["skipped"] = why_not(variant, device, dry)
    started, done = time.perf_counter(), 0
    for _ in range(rounds):
        next_round = 0.0
        for variant, result in results.items():
            if result["skipped"] or result.get("error"):
                continue
            try:
                figures = measure(variant, sizes, device)
            except Exception as error:  # noqa: BLE001 - one failing loop must not end the table
                result["error"] = f"{type(error).__name__}: {error}"
                continue
            result["rates"].append(figures["steps_per_s"])
            result["peaks"].append(figures["peak_mib"])
            result["float8"] = figures["float8"]
            next_round += figures["next_round_s"]
        done += 1
        if time.perf_counter() - started + next_round > budget:  # the next round would not fit
            break
    return results, done


# -- paired blocks: the ratios the goal names, with host drift cancelled ----------------

# The comparisons held to >= 0.98x of the hand-written loop, and a control: the
# hand-written loop against a second copy of itself, the noise floor of the others.
PAIRS = [
    ("lm", "bf16", "notebook_accel"),
    ("lm", "fp16", "notebook_accel"),
    ("mlp", "no", "notebook_accel"),
    ("lm", "bf16", "hand-written"),
    ("mlp", "no", "hand-written"),
]
BLOCK_STEPS = {"lm": 8, "mlp": 40}


def timed_block(run: Run, steps: int, device: torch.device) -> float:
    synchronize(device)
    started = time.perf_counter()
    for _ in range(steps):
        next(run.steps)
    synchronize(device)
    return time.perf_counter() - started


def paired(model: str, precision: str, loop: str, sizes: Sizes, device, pairs: int) -> dict:
    """`loop` against the hand-written loop, both built at once, in alternating blocks
    of a few steps (ABBA order). A machine whose host speed drifts by 10-20% within
    seconds moves both sides of a pair alike, so the median of the per-pair ratios
    is steadier than a ratio of medians of separate runs."""
    block = 2 if sizes is TINY else BLOCK_STEPS[model]
    warmup = sizes.warmup[model]
    batches = warmup + pairs * block
    reference = hand_written(Variant(model, "hand-written", precision), sizes, device, batches)
    candidate = LOOPS[loop](Variant(model, loop, precision), sizes, device, batches)
    try:
        for _ in range(warmup):
            next(reference.steps)
            next(candidate.steps)
        ratios = []
        for index in range(pairs):
            if index % 2 == 0:
                ours, theirs = (
                    timed_block(candidate, block, device),
                    timed_block(reference, block, device),
                )
            else:
                theirs = timed_block(reference, block, device)
                ours = timed_block(candidate, block, device)
            ratios.append(theirs / ours)  # steps/s of ours over the hand-written loop's
        return {"median": statistics.median(ratios), "ratios": ratios, "block_steps": block}
    finally:
        candidate.close()
        reference.close()


def paired_ratios(sizes: Sizes, device: torch.device, pairs: int) -> list[dict]:
    found = []
    for model, precision, loop in PAIRS:
        row = {"model": model, "precision": precision, "loop": loop}
        try:
            row.update(paired(model, precision, loop, sizes, device, pairs))
        except Exception as error:  # noqa: BLE001 - reported in the table instead
            row["error"] = f"{type(error).__name__}: {error}"
        found.append(row)
        gc.collect()
    return found


def paired_markdown(rows: list[dict], pairs: int) -> str:
    lines = [
        f"Paired blocks ({pairs} pairs, ABBA order): steps/s against the hand-written loop, "
        "median of the per-pair ratios; the hand-written rows are the noise floor.",
        "",
        "| model | precision | loop | median | lowest | highest |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "error" in row:
            lines.append(
                f"| {row['model']} | {row['precision']} | {row['loop']} | {row['error']} | | |"
            )
            continue
        lines.append(
            f"| {row['model']} | {row['precision']} | {row['loop']} | {row['median']:.3f}x | "
            f"{min(row['ratios']):.3f}x | {max(row['ratios']):.3f}x |"
        )
    return "\n".join(lines)


# -- call -> first step of a forked worker -------------------------------------------


def _first_step() -> float:
    from notebook_accel import Accelerator

    accelerator = Accelerator()
    model = torch.nn.Linear(16, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    model(torch.randn(8, 16, device=accelerator.device)).square().mean().backward()
    optimizer.step()
    synchronize(accelerator.device)
    return time.time()


def launch_to_first_step(launches: int = 2) -> dict:
    """Seconds from the launch call to the first optimizer step of a forked worker.

    Must run before this process touches CUDA (a forked worker cannot use the
    GPU once its parent has). Between launches the kernel-side warming finishes.
    """
    try:
        from notebook_accel import last_run
        from notebook_accel.launch.launcher import run_plan
        from notebook_accel.launch.preflight import plan_launch
        from notebook_accel.reporting.observers import ConsoleObserver

        seconds = []
        for _ in range(launches):
            called = time.time()
            # single_in_process=False: one GPU still gets a forked worker.
            plan = plan_launch(
                function=_first_step, num_processes=1, backend="cuda", single_in_process=False
            )
            stepped = run_plan(plan, ConsoleObserver(plan.output))
            seconds.append(stepped - called)
            last_run().warming.wait(60)
        return {"seconds": seconds}
    except Exception as error:  # noqa: BLE001 - reported in the table instead
        return {"error": f"{type(error).__name__}: {error}"}


# -- the table ----------------------------------------------------------------------


def rows_of(results: dict[Variant, dict]) -> list[dict]:
    """One plain dict per row: the medians and the ratios the table shows."""
    rows = []
    for variant, result in results.items():
        rates = result["rates"]
        rows.append(
            {
                **asdict(variant),
                "label": variant.label,
                "steps_per_s": statistics.median(rates) if rates else None,
                "rounds": rates,
                "peak_mib": max(result["peaks"]) if result["peaks"] else None,
                "float8": result.get("float8"),
                "skipped": result.get("skipped"),
                "error": result.get("error"),
            }
        )
    for row in rows:
        row["vs_hand_written"] = _ratio(row, rows, loop="hand-written", pinned=True, compiled=False)
        if row["precision"] == "fp8":
            row["vs_own_bf16"] = _ratio(row, rows, precision="bf16")
    return rows


def _ratio(row: dict, rows: list[dict], **reference: Any) -> float | None:
    """`row`'s rate over that of the row like it but for `reference`'s fields."""
    if row["steps_per_s"] is None:
        return None
    want = {**row, **reference}
    keys = ("model", "loop", "precision", "compiled", "pinned", "non_blocking")
    if "loop" in reference:  # against hand-written: same model and precision, eager
        want["precision"] = row["precision"] if row["precision"] != "fp8" else "bf16"
        want["non_blocking"] = None
    for other in rows:
        if all(other[k] == want[k] for k in keys) and other["steps_per_s"]:
            return row["steps_per_s"] / other["steps_per_s"]
    return None


def markdown(rows: list[dict], environment: dict, launch: dict) -> str:
    """The table as markdown, headed by the machine and the versions."""
    lines = [
        f"GPU: {environment['gpu']} (capability {environment['capability']}); torch "
        f"{environment['torch']}, CUDA {environment['cuda']}, torchao {environment['torchao']}, "
        f"Accelerate {environment['accelerate']}; median of {environment['rounds_done']} "
        f"round(s).",
        "",
        "| model | loop | precision | compiled | steps/s | vs hand-written | fp8 vs its bf16 "
        "| float8 layers | peak MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row["steps_per_s"] is None:
            why = row["skipped"] or row["error"] or "no figure"
            lines.append(
                f"| {row['model']} | {row['label']} | {row['precision']} | "
                f"{'inductor' if row['compiled'] else 'no'} | - | {why} | | | |"
            )
            continue
        lines.append(
            f"| {row['model']} | {row['label']} | {row['precision']} | "
            f"{'inductor' if row['compiled'] else 'no'} | {row['steps_per_s']:.1f} | "
            f"{_times(row['vs_hand_written'])} | {_times(row.get('vs_own_bf16'))} | "
            f"{row['float8'] if row['precision'] == 'fp8' else ''} | {row['peak_mib']:,.0f} |"
        )
    if "seconds" in launch:
        figures = ", then ".join(f"{s:.2f} s" for s in launch["seconds"])
        lines += ["", f"Launch call -> first optimizer step of a forked worker: {figures}."]
    elif "error" in launch or "skipped" in launch:
        lines += ["", f"Launch call -> first step: {launch.get('error') or launch['skipped']}."]
    return "\n".join(lines)


def _times(ratio: float | None) -> str:
    return "" if ratio is None else f"{ratio:.2f}x"


def environment(device: torch.device) -> dict:
    def version(name: str) -> str:
        if importlib.util.find_spec(name) is None:
            return "not installed"
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as installed

        try:
            return installed(name)
        except PackageNotFoundError:
            return "unknown"

    cuda = device.type == "cuda"
    return {
        "gpu": torch.cuda.get_device_name(device) if cuda else f"none (CPU: {platform.machine()})",
        "capability": ".".join(map(str, torch.cuda.get_device_capability(device))) if cuda else "-",
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "-",
        "torchao": version("torchao"),
        "accelerate": version("accelerate"),
        "python": sys.version.split()[0],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget", type=float, default=240.0, help="seconds for the whole run")
    parser.add_argument(
        "--pairs", type=int, default=16, help="paired blocks per comparison (0: none)"
    )
    parser.add_argument("--json", default="bench-gpu.json", help="where to write the figures")
    parser.add_argument(
        "--dry-run", action="store_true", help="tiny models on the CPU, one round: no figures"
    )
    options = parser.parse_args(argv)
    started = time.perf_counter()
    if options.dry_run:
        device, sizes, rounds = torch.device("cpu"), TINY, 1
        launch: dict = {"skipped": "dry run"}
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here; `python bench/gpu.py --dry-run` checks the script")
    else:
        device, sizes, rounds = torch.device("cuda", 0), Sizes(), options.rounds
        launch = launch_to_first_step()  # before CUDA starts in this process
    warnings.simplefilter("once")
    budget = options.budget - (time.perf_counter() - started)
    results, done = measure_rounds(variants(), sizes, device, rounds, budget, options.dry_run)
    facts = {**environment(device), "rounds_done": done, "rounds_asked": rounds}
    rows = rows_of(results)
    pairs = 2 if options.dry_run else options.pairs
    paired_rows = paired_ratios(sizes, device, pairs) if pairs else []
    facts["seconds"] = round(time.perf_counter() - started, 1)
    print(markdown(rows, facts, launch))
    if paired_rows:
        print("\n" + paired_markdown(paired_rows, pairs))
    if done < rounds:
        print(f"\n(the {options.budget:.0f} s budget allowed {done} of {rounds} rounds)")
    with open(options.json, "w") as out:
        figures = {"environment": facts, "launch": launch, "rows": rows, "paired": paired_rows}
        json.dump(figures, out, indent=1)
    print(f"\nfigures written to {options.json} ({facts['seconds']} s)")


if __name__ == "__main__":
    main()
