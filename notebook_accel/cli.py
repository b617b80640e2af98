"""The `notebook-accel` command."""

from __future__ import annotations

import argparse

from notebook_accel import demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="notebook-accel",
        description="Train PyTorch models on every device of this machine.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser(
        "demo", help="train a small model on synthetic data", description=demo.__doc__
    )
    demo.add_arguments(demo_parser)
    options = parser.parse_args(argv)
    if options.command == "demo":
        return demo.run(options)
    parser.error(f"unknown command {options.command}")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
