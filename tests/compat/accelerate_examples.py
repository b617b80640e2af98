"""Accelerate's own example scripts, unchanged, found and checked byte for byte.

The scripts (`examples/*.py` and `examples/by_feature/*.py` of
huggingface/accelerate) are not part of the accelerate package: neither its
wheel nor its sdist ships `examples/`. They are not copied into this
repository either. Each is pinned here by its git blob id (the SHA-1 git gives
the file), and obtained from the first of these that has it:

1. `NOTEBOOK_ACCEL_ACCELERATE_EXAMPLES`: a directory with Accelerate's
   `examples/` in it (or a checkout of the repository);
2. the cache, `~/.cache/notebook_accel/accelerate-examples/<blob id>/<name>.py`
   (`NOTEBOOK_ACCEL_CACHE` moves it), filled by the sources below;
3. `shared/accelerate-examples` beside the project root (`../shared/...` from it),
   where the project's machines and CI keep the pinned scripts with their licence;
4. the accelerate sdist from the package index (`pip download`), should a
   release ship `examples/` again;
5. the repository on GitHub at the pinned commit.

A file whose blob id differs is refused, so whatever the source, the scripts
run exactly as released. The pinned files are those of Accelerate v1.14.0,
which stayed unchanged on its main branch through 1.15.0.dev0.

    python tests/compat/accelerate_examples.py          # fill the cache, say from where
    python tests/compat/accelerate_examples.py --check  # only say what is missing
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

ACCELERATE_COMMIT = "beb0672aa8444ea7647aee056f624effe5996346"  # the v1.14.0 tag
SDIST_VERSION = "1.15.0"

# script (path under examples/, without .py) -> git blob id of the released file
SCRIPTS = {
    "nlp_example": "7f7877120fd240f0b7d0d7c152aaa4479d648bbf",
    "cv_example": "07b6f588b8ab93744ebfe1a3549f5d4da46f0cc7",
    "complete_nlp_example": "24decd17fc27f4bcac7332058105368c37eccf71",
    "complete_cv_example": "76036f12699ec0575c2be366db20d5a9b699c24f",
    "by_feature/automatic_gradient_accumulation": "90e2bf0e0786d70f30f92a7704ade8df6227b500",
    "by_feature/checkpointing": "43ccf311acfc9487bf6e13f8daa5be9fb0ce8390",
    "by_feature/cross_validation": "a99a9d9975755941754b76316e12f4c0bdf01b60",
    "by_feature/ddp_comm_hook": "c5f27432132a7dfc82e375c75d53f44bc2624e76",
    "by_feature/early_stopping": "2ec96b4347ca909d4e45d19b42d26592f60d27f9",
    "by_feature/gradient_accumulation": "9ac78062c024d0d650a24c63ccd959d3f097d097",
    "by_feature/gradient_accumulation_for_autoregressive_models": (
        "64fb6d6aa10121e90c1a4d61eb08d768799ba23a"
    ),
    "by_feature/local_sgd": "5c15924277fe067fdf7c4a251732aa562378079a",
    "by_feature/memory": "d57173f86892c9f5eebd2f86db3423996135c954",
    "by_feature/multi_process_metrics": "60255de75f6e3c97b2ff6504eae5a4de7662baa9",
    "by_feature/profiler": "6dc6eedc03f4a0aa5dd37c802a6e91ccdce5bc27",
    "by_feature/schedule_free": "2e1ff0f1b3a2256169a66e7cdafe354fe8bd5d83",
    "by_feature/tracking": "c9336ee249121dac0cc5d92b83b4eeffdcbd296d",
}

ENV_DIRECTORY = "NOTEBOOK_ACCEL_ACCELERATE_EXAMPLES"
# The project root's sibling shared/ folder (resolved from this file, not the working directory).
SHARED_COPY = Path(__file__).resolve().parents[2].parent / "shared" / "accelerate-examples"


class ScriptsUnavailable(RuntimeError):
    """Some scripts could be found nowhere; the message says where it looked and how to help.

    `changed` names the files a source gave with other bytes than the pinned ones.
    """

    def __init__(self, message: str, changed: list[str]):
        super().__init__(message)
        self.changed = changed


def blob_id(data: bytes) -> str:
    """The id git gives a file with these bytes."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def cache_dir() -> Path:
    root = os.environ.get("NOTEBOOK_ACCEL_CACHE") or Path.home() / ".cache" / "notebook_accel"
    return Path(root) / "accelerate-examples"


def _cached_path(folder: Path, name: str) -> Path:
    """Where the cache keeps `name`: under its blob id, with its own file name (which
    scripts read through `__file__`)."""
    return folder / SCRIPTS[name] / f"{Path(name).name}.py"


def _from_directory(root: Path, names: list[str]) -> dict[str, bytes]:
    found = {}
    for name in names:
        for base in (root / "examples", root):
            path = base / f"{name}.py"
            if path.is_file():
                found[name] = path.read_bytes()
                break
    return found


def _from_sdist(names: list[str]) -> dict[str, bytes]:
    """The scripts in accelerate's sdist, if it has them (1.15.0's does not)."""
    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
        command += ["--no-binary", ":all:", "-d", folder, f"accelerate=={SDIST_VERSION}"]
        try:
            subprocess.run(command, check=True, capture_output=True, timeout=120)
        except (subprocess.SubprocessError, OSError):
            return {}
        found = {}
        for archive in Path(folder).glob("accelerate-*.tar.gz"):
            with tarfile.open(archive) as tar:
                found.update(_examples_in(tar, names))
        return found


def _from_github(names: list[str]) -> dict[str, bytes]:
    url = f"https://codeload.github.com/huggingface/accelerate/tar.gz/{ACCELERATE_COMMIT}"
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            data = response.read()
    except OSError:
        return {}
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return _examples_in(tar, names)


def _examples_in(tar: tarfile.TarFile, names: list[str]) -> dict[str, bytes]:
    """The scripts among `names` under an `examples/` folder of an archive of the repository."""
    found = {}
    for member in tar.getmembers():
        parts = member.name.split("/examples/", 1)
        name = parts[-1].removesuffix(".py")
        if len(parts) == 2 and name in names and member.isfile():
            found[name] = tar.extractfile(member).read()
    return found


def _sources() -> list[tuple[str, object]]:
    sources: list[tuple[str, object]] = []
    if os.environ.get(ENV_DIRECTORY):
        root = Path(os.environ[ENV_DIRECTORY])
        sources.append((f"{ENV_DIRECTORY}={root}", lambda names: _from_directory(root, names)))
    if SHARED_COPY.is_dir():
        sources.append((str(SHARED_COPY), lambda names: _from_directory(SHARED_COPY, names)))
    sources.append((f"the accelerate {SDIST_VERSION} sdist", _from_sdist))
    sources.append(("GitHub", _from_github))
    return sources


def scripts(names: list[str] | None = None) -> dict[str, Path]:
    """script name -> the cached, checked file of each of `names` (default: all 17).

    Raises ScriptsUnavailable naming what is missing and the sources tried.
    """
    names = list(SCRIPTS if names is None else names)
    folder = cache_dir()
    cached = {name: _cached_path(folder, name) for name in names}
    missing = [name for name in names if not cached[name].is_file()]
    tried = []
    wrong = []
    for label, source in _sources() if missing else []:
        found = source(missing)
        tried.append(label)
        for name, data in found.items():
            if blob_id(data) != SCRIPTS[name]:
                wrong.append(f"{name} from {label}")
                continue
            cached[name].parent.mkdir(parents=True, exist_ok=True)
            partial = cached[name].with_suffix(".partial")
            partial.write_bytes(data)
            partial.replace(cached[name])  # atomic: a half-written file is never cached
        missing = [name for name in missing if not cached[name].is_file()]
        if not missing:
            break
    if missing:
        raise ScriptsUnavailable(
            f"{len(missing)} of Accelerate's example scripts are not available "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); tried "
            f"{', '.join(tried)}"
            + (f"; refused as changed: {', '.join(wrong)}" if wrong else "")
            + f". Point {ENV_DIRECTORY} at a checkout of huggingface/accelerate "
            f"(commit {ACCELERATE_COMMIT[:10]}, tag v1.14.0), or run "
            "`python tests/compat/accelerate_examples.py` where GitHub is reachable "
            f"to fill {folder}.",
            changed=wrong,
        )
    return cached


if __name__ == "__main__":
    try:
        if "--check" in sys.argv:
            folder = cache_dir()
            absent = [n for n in SCRIPTS if not _cached_path(folder, n).is_file()]
            print(f"{len(SCRIPTS) - len(absent)} of {len(SCRIPTS)} scripts cached in {folder}")
            sys.exit(1 if absent else 0)
        found = scripts()
        print(f"all {len(found)} scripts cached in {cache_dir()}")
    except ScriptsUnavailable as error:
        print(error, file=sys.stderr)
        sys.exit(1)
