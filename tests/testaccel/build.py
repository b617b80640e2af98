"""Build the testaccel extension (or find it in the cache) and say where and how long.

Usage: python tests/testaccel/build.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    started = time.monotonic()
    import testaccel

    library = testaccel.build(verbose="-v" in sys.argv[1:])
    seconds = time.monotonic() - started
    print(f"testaccel: {library} ({seconds:.1f} s, torch {testaccel.torch.__version__})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
