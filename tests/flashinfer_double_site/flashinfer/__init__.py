"""`import flashinfer` -> tests/flashinfer_double.py, for processes that put this folder first on sys.path (the
flashinfer_double fixture does, and spawned tensor-parallel workers inherit the parent's sys.path)."""
import sys

import flashinfer_double

sys.modules[__name__] = flashinfer_double
