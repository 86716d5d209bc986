"""Puts ``examples/`` on ``sys.path``: examples run as scripts, and the shared helpers
(``common.py``, ``paddle_common.py``, ``primer_common.py``) live one folder up."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
