"""Makes this folder's helper modules (engine_helpers, test_server_support) importable
from its subfolders' tests, such as tests/actors/serve/."""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
