"""The big-model tests import their small models from big_models.py, next to them."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
