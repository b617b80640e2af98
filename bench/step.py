"""Training-step speed of the Accelerator against a hand-written DDP loop.

Two gloo workers (one torch thread each, the launcher's default) train the same
MLP (3 linear layers of width 512, batch 64 per process, SGD, synthetic data):
  hand-written  DistributedDataParallel + DistributedSampler, plain loop
  notebook_accel  Accelerator().prepare(...) with accumulate/backward
  accelerate    Accelerate 1.15's Accelerator, when installed
  hand-written, again  the reference once more: the noise floor of every ratio
from the same initial weights on the same data; the script checks that they
end with the same weights.

Shared 2-core machines drift by 10-20% within seconds, so the loops take turns
in short passes (the order reversed every round) and each ratio is the median
of the ratios of passes run next to each other:

    python bench/step.py [--steps 60] [--rounds 15]   one launch, loops take turns
    python bench/step.py --separate [--rounds 5]      each pass in a launch of its own
    python bench/step.py --breakdown                  where a step's time goes
    python bench/step.py --breakdown --width 16       the same on a tiny, overhead-bound MLP
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from notebook_accel import notebook_launcher

WIDTH, CLASSES, BATCH, WORKERS = 512, 10, 64, 2
REFERENCE = "hand-written DDP"
CONTROL = "hand-written, again"
# The phases of one step that --breakdown times, in order.
PHASES = ("next batch", "enter accumulate", "forward", "backward", "step", "zero_grad", "exit")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, CLASSES),
    )


def _dataset(steps: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    n = steps * BATCH * WORKERS
    return TensorDataset(
        torch.randn(n, WIDTH, generator=g), torch.randint(CLASSES, (n,), generator=g)
    )


def _lockstep(loops: dict, steps: int, warmup: int = 5) -> tuple[dict, dict]:
    """Run the loops a step each in turn: the seconds of each loop's steps after the
    warm-up, and its weights at the end. Speeds come from the median step (a mean
    would count the machine's hiccups).

    Every step of one loop is timed next to a step of each other loop, so a machine
    that drifts, as shared machines do within seconds, slows them all alike.
    """
    running = {name: loop(steps) for name, loop in loops.items()}
    times: dict[str, list[float]] = {name: [] for name in loops}
    last = {}
    clock = time.perf_counter
    for _ in range(steps):
        for name, steps_of in running.items():
            before = clock()
            last[name] = next(steps_of)
            times[name].append(clock() - before)
    for steps_of in running.values():
        next(steps_of, None)  # each loop's pass ends as it would on its own
    rates = {name: t[warmup:] for name, t in times.items()}
    weights = {
        name: [p.detach().clone() for p in model.parameters()] for name, model in last.items()
    }
    return rates, weights


def hand_written(steps: int, phases: dict | None = None):
    """The plain loop; with `phases`, the time of each phase is added to it."""
    from torch.nn.parallel import DistributedDataParallel

    data = _dataset(steps)
    loader = DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, shuffle=False))
    model = DistributedDataParallel(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    yield from _loop(loader, model, opt, contextlib.nullcontext, _plain_backward, phases)


def ours(steps: int, phases: dict | None = None):
    from notebook_accel import Accelerator

    yield from _accelerated_loop(Accelerator(), steps, phases)


def theirs(steps: int, phases: dict | None = None):
    import accelerate
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield from _accelerated_loop(accelerate.Accelerator(cpu=True), steps, phases)


def _accelerated_loop(acc, steps: int, phases: dict | None):
    """The same training code for both Accelerators: porting is an import change."""
    model = _model()
    model, opt, loader = acc.prepare(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        DataLoader(_dataset(steps), batch_size=BATCH),
    )
    yield from _loop(loader, model, opt, lambda: acc.accumulate(model), acc.backward, phases)


def _plain_backward(loss: torch.Tensor) -> None:
    loss.backward()


def _loop(loader, model, opt, accumulate, backward, phases: dict | None):
    """`for x, y in loader: with accumulate(): backward(loss(model(x), y)); step; zero_grad`,
    yielding the bare model after each step; with `phases`, timing each part."""
    unwrapped = getattr(model, "module", model)
    if phases is None:
        for x, y in loader:
            with accumulate():
                backward(torch.nn.functional.cross_entropy(model(x), y))
                opt.step()
                opt.zero_grad()
            yield unwrapped
        return
    clock, batches = time.perf_counter_ns, iter(loader)
    while True:
        marks = [clock()]
        try:
            x, y = next(batches)
        except StopIteration:
            return
        marks.append(clock())
        context = accumulate()
        context.__enter__()
        marks.append(clock())
        loss = torch.nn.functional.cross_entropy(model(x), y)
        marks.append(clock())
        backward(loss)
        marks.append(clock())
        opt.step()
        marks.append(clock())
        opt.zero_grad()
        marks.append(clock())
        context.__exit__(None, None, None)
        marks.append(clock())
        for name, begin, end in zip(PHASES, marks, marks[1:], strict=False):
            phases.setdefault(name, []).append(end - begin)
        yield unwrapped


def _variants() -> dict:
    import importlib.util

    variants = {REFERENCE: hand_written, "notebook_accel": ours}
    if importlib.util.find_spec("accelerate") is not None:
        variants["accelerate"] = theirs
    # The reference against itself: how far apart two identical loops measure here,
    # the noise any other ratio carries.
    variants[CONTROL] = hand_written
    return variants


def interleaved(steps: int, rounds: int) -> dict:
    """In one launch: the loops in lockstep, their order reversed every round."""
    from notebook_accel import Accelerator

    Accelerator()  # joins the process group, which the hand-written loop then uses too
    variants = _variants()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for index in range(rounds):
        order = dict(reversed(variants.items())) if index % 2 else variants
        passed, weights = _lockstep(order, steps)
        for name, step_times in passed.items():
            times[name].extend(step_times)
    return {"times": times, "drift": _drift(weights), "threads": torch.get_num_threads()}


def one_loop(name: str, steps: int) -> dict:
    """In a launch of its own: one pass of one loop."""
    from notebook_accel import Accelerator

    Accelerator()
    times, weights = _lockstep({name: _variants()[name]}, steps)
    return {"rate": 1 / statistics.median(times[name]), "weights": weights[name]}


def breakdown(steps: int, rounds: int) -> dict:
    """Microseconds per step in each phase, hand-written and ours, taking turns."""
    from notebook_accel import Accelerator

    Accelerator()
    loops = {REFERENCE: hand_written, "notebook_accel": ours}
    phases: dict[str, dict] = {name: {} for name in loops}
    for _ in range(rounds):
        for name, loop in loops.items():
            for _model_after_step in loop(steps, phases[name]):
                pass
    return {
        name: {phase: statistics.median(times) / 1000 for phase, times in timed.items()}
        for name, timed in phases.items()
    }


def _drift(weights: dict) -> dict:
    reference = weights[REFERENCE]
    return {
        name: max((a - b).abs().max().item() for a, b in zip(w, reference, strict=True))
        for name, w in weights.items()
    }


def _print_rates(rates: dict[str, float], drift: dict, threads: int, header: str) -> None:
    print(header)
    print(f"{'loop':<20}{'steps/s':>9}{'vs hand-written':>17}{'max |dw|':>11}{'threads':>9}")
    for name, rate in rates.items():
        ratio = rate / rates[REFERENCE]
        print(f"{name:<20}{rate:>9.1f}{ratio:>16.3f}x{drift[name]:>11.1e}{threads:>9}")
    worst = max(drift.values())
    if worst > 1e-4:
        raise SystemExit(f"the loops disagree: weights differ by up to {worst:.1e}")
    print("all loops reach the same weights")


def _set_width(width: int) -> None:
    global WIDTH
    WIDTH = width  # the workers are forked: they see it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="steps per pass")
    parser.add_argument("--rounds", type=int, default=15, help="passes of each loop")
    parser.add_argument("--separate", action="store_true", help="each pass in its own launch")
    parser.add_argument("--breakdown", action="store_true", help="time each phase of a step")
    parser.add_argument("--width", type=int, default=WIDTH, help="the MLP's width")
    options = parser.parse_args()
    _set_width(options.width)
    setup = f"{WORKERS} gloo workers, MLP width {WIDTH}, batch {BATCH}/process"
    if options.breakdown:
        result = notebook_launcher(
            breakdown, args=(options.steps, options.rounds), num_processes=WORKERS
        )
        ref, our = result[REFERENCE], result["notebook_accel"]
        print(f"{setup}: median microseconds per step, rank 0, {options.rounds} passes each")
        print(f"{'phase':<18}{'hand-written':>13}{'notebook_accel':>16}{'difference':>12}")
        for phase in PHASES:
            extra = our[phase] - ref[phase]
            print(f"{phase:<18}{ref[phase]:>13.1f}{our[phase]:>16.1f}{extra:>+12.1f}")
        return
    if options.separate:
        rates: dict[str, list[float]] = {name: [] for name in _variants()}
        weights = {}
        for index in range(options.rounds):
            names = list(rates) if index % 2 == 0 else list(reversed(rates))
            for name in names:
                run = notebook_launcher(one_loop, args=(name, options.steps), num_processes=WORKERS)
                rates[name].append(run["rate"])
                weights[name] = run["weights"]
        header = f"{setup}, {options.steps} steps, each pass a launch, {options.rounds} rounds"
        medians = {name: statistics.median(runs) for name, runs in rates.items()}
        _print_rates(medians, _drift(weights), 1, header)
        return
    result = notebook_launcher(
        interleaved, args=(options.steps, options.rounds), num_processes=WORKERS
    )
    header = f"{setup}, {options.steps} steps a pass, {options.rounds} rounds in one launch"
    medians = {name: 1 / statistics.median(times) for name, times in result["times"].items()}
    _print_rates(medians, result["drift"], result["threads"], header)


if __name__ == "__main__":
    main()
