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


def pytest_sessionfinish(session, exitstatus):
    """With EPX_CPU_TESTS_MUST_RUN=1 (CI sets it), a skipped test of the CPU suite fails the run: there, torch,
    megatron-core and matplotlib are installed, so a skip means a test that silently stopped running."""
    if os.environ.get("EPX_CPU_TESTS_MUST_RUN") != "1":
        return
    cpu_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu")
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = [r for r in (reporter.stats.get("skipped", []) if reporter else [])
               if os.path.abspath(str(r.fspath)).startswith(cpu_dir)]
    if skipped:
        reporter.write_line(f"EPX_CPU_TESTS_MUST_RUN=1: {len(skipped)} CPU test(s) skipped", red=True)
        session.exitstatus = 1
