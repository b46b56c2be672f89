import os
import sys

# Test helpers (op_checks, _dist, models) are imported by name from this folder and from gpu/.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
