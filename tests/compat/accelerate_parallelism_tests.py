"""Run Accelerate's own tests of `ParallelismConfig` against notebook_accel.

They are the class `TestParallelismConfig` of Accelerate's `tests/test_dataclasses.py`,
which its wheel does not ship; its sdist does. Run them with a checkout of
huggingface/accelerate, the file itself, or nothing (the file from the accelerate
sdist, downloaded once with `pip download` and kept in the cache):

    python tests/compat/accelerate_parallelism_tests.py
    python tests/compat/accelerate_parallelism_tests.py ACCELERATE_CHECKOUT

The class runs twice with pytest, each time in a fresh interpreter: as it is (under
Accelerate), and with the names it imports from `accelerate.X` that notebook_accel has
imported from notebook_accel instead (accelerate_unit_tests.resolve: the one-line port a
user makes). It prints the counts under each library and every test whose outcome
differs. tests/compat/test_accelerate_parallelism.py runs it on the sdist's file.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import accelerate_test_files  # noqa: E402
import accelerate_unit_tests  # noqa: E402

TEST_FILE = "test_dataclasses.py"
TEST_CLASS = "TestParallelismConfig"
SDIST_VERSION = "1.15.0"  # the dev dependency's version
# git's blob id of the sdist's tests/test_dataclasses.py: another file is refused
SDIST_BLOB = "a6c463d4d18d519bb99e7ad9205d4e89413d8df1"


class SdistUnavailable(RuntimeError):
    """pip could not download the accelerate sdist (the message says why)."""


def blob_id(data: bytes) -> str:
    """The id git gives a file with these bytes."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def cache_file() -> Path:
    """Where the sdist's test file is kept: NOTEBOOK_ACCEL_CACHE, else ~/.cache/notebook_accel."""
    root = os.environ.get("NOTEBOOK_ACCEL_CACHE") or Path.home() / ".cache" / "notebook_accel"
    return Path(root) / f"accelerate-{SDIST_VERSION}-tests" / TEST_FILE


def sdist_test_file() -> Path:
    """The sdist's tests/test_dataclasses.py, from the cache or downloaded into it."""
    cached = cache_file()
    if cached.is_file() and blob_id(cached.read_bytes()) == SDIST_BLOB:
        return cached
    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
        command += ["--no-binary", ":all:", "-d", folder, f"accelerate=={SDIST_VERSION}"]
        try:
            subprocess.run(command, check=True, capture_output=True, text=True, timeout=300)
        except subprocess.CalledProcessError as error:
            raise SdistUnavailable(f"pip download failed: {error.stderr[-1000:]}") from None
        except (OSError, subprocess.TimeoutExpired) as error:
            raise SdistUnavailable(f"pip download failed: {error}") from None
        archive = Path(folder, f"accelerate-{SDIST_VERSION}.tar.gz")
        with tarfile.open(archive) as tar:
            member = tar.extractfile(f"accelerate-{SDIST_VERSION}/tests/{TEST_FILE}")
            data = member.read() if member is not None else b""
    if blob_id(data) != SDIST_BLOB:
        raise RuntimeError(
            f"the accelerate {SDIST_VERSION} sdist's tests/{TEST_FILE} is not the pinned file "
            f"(blob {SDIST_BLOB[:10]}): refusing to run it"
        )
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial = cached.with_suffix(".partial")
    partial.write_bytes(data)
    partial.replace(cached)  # atomic: a half-written file is never cached
    return cached


def run(files: list[Path], hide_gpus: bool = False) -> dict[str, dict[str, str]]:
    """library -> {test id -> outcome} for the class in `files`, both ways."""
    return accelerate_test_files.run_both_ways(
        files, accelerate_unit_tests.resolve, hide_gpus, select=TEST_CLASS
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "paths", nargs="*", help="an Accelerate checkout or the test file (default: the sdist's)"
    )
    parser.add_argument("--cpu", action="store_true", help="hide GPUs from both runs")
    options = parser.parse_args()
    if options.paths:
        files = accelerate_test_files.find_test_files(options.paths, [TEST_FILE])
    else:
        try:
            files = [sdist_test_file()]
        except SdistUnavailable as error:
            raise SystemExit(f"{error}\npass an Accelerate checkout or its {TEST_FILE}") from None
    accelerate_test_files.print_comparison(run(files, options.cpu))


if __name__ == "__main__":
    main()
