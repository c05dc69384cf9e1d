"""Makes the epx package importable from the source tree: python/ goes on sys.path, and so does
<build>/python (where the compiled extension lives) when EPX_BUILD_DIR names the build folder. CTest sets
PYTHONPATH itself; by hand: PYTHONPATH=python:build-py/python python -m pytest tests/python/cpu. tests/python
goes there too, for the helpers the CPU and GPU tests share."""

import os
import sys

_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for _path in (os.path.join(os.environ["EPX_BUILD_DIR"], "python") if os.environ.get("EPX_BUILD_DIR") else None,
              os.path.join(_root, "python"), os.path.dirname(os.path.abspath(__file__))):
    if _path and _path not in sys.path:
        sys.path.insert(0, _path)
