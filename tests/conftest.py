import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

# XLA compiles without its backend optimizations in the test suite: most of its time is compiling
# small programs once each (every OpInfo sample's shapes), which this makes ~15% faster, and the
# optimizations do not change what the programs compute. Users' programs compile as JAX's default.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
