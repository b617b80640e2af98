"""The language-model tests import their model and runs from llm_runs.py, next to them."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
