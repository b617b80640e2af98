"""Run All in many fresh interpreters: a launch, the kernel's own optimizer at once, a launch.

Each round is a fresh interpreter (nothing heavy imported yet) that does what
a notebook's Run All does: a launch whose function builds torch.optim.AdamW,
then at once an AdamW in the kernel itself, then a second launch. A round is
clean when both launches return, the kernel's optimizer steps, and nothing is
printed to stderr (no traceback, no "Exception ignored" from a fork hook).
Prints the count of clean rounds and the first problems seen.

    python bench/run_all.py [--rounds 100] [--transformers] [--python PATH]

--transformers: the training function imports transformers itself, as
Accelerate's docs advise. --python: another interpreter, for instance the
torch_xla test environment (tests/xla/make_env.py) with PJRT_DEVICE=CPU set,
to run the same round on XLA's CPU device (--xla).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

ROUND = """
import torch
from notebook_accel import Accelerator, notebook_launcher

def train():
    {imports}
    accelerator = Accelerator()
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.backward(model(torch.randn(3, 4, device=accelerator.device)).sum())
    optimizer.step()

notebook_launcher(train, {launch})
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.AdamW(model.parameters())
model(torch.randn(3, 4)).sum().backward()
optimizer.step()
notebook_launcher(train, {launch})
print("CLEAN")
"""

# A clean round takes a few seconds; one this long has hung.
ROUND_SECONDS = 150

CPU_LAUNCH = 'num_processes=2, backend="cpu", live=False'
XLA_LAUNCH = 'num_processes=1, backend="xla", single_in_process=False, live=False'


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--transformers", action="store_true")
    parser.add_argument("--xla", action="store_true", help="one worker on XLA's CPU device")
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args()
    imports = "import transformers" if args.transformers else "pass"
    code = ROUND.format(imports=imports, launch=XLA_LAUNCH if args.xla else CPU_LAUNCH)
    env = dict(os.environ)
    # This checkout first: the torch_xla environment holds no copy of the project.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    if args.xla:
        env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1")
    if args.transformers:
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    clean, problems, started = 0, [], time.monotonic()
    for round_ in range(args.rounds):
        try:
            done = subprocess.run(
                [args.python, "-c", code],
                capture_output=True,
                text=True,
                timeout=ROUND_SECONDS,
                env=env,
            )
        except subprocess.TimeoutExpired:  # killed by subprocess.run, so nothing is left
            problems.append(f"round {round_ + 1}: no end within {ROUND_SECONDS} s (a hang)")
            continue
        if done.returncode == 0 and "CLEAN" in done.stdout and not done.stderr.strip():
            clean += 1
        else:
            problems.append(f"round {round_ + 1}: exit {done.returncode}\n{done.stderr[-1500:]}")
    print(
        f"{clean} of {args.rounds} rounds clean "
        f"({time.monotonic() - started:.0f} s; launch options: "
        f"{XLA_LAUNCH if args.xla else CPU_LAUNCH}; transformers imported: {args.transformers})"
    )
    for problem in problems[:3]:
        print(problem)
    sys.exit(0 if clean == args.rounds else 1)


if __name__ == "__main__":
    main()
