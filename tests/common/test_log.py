"""fsdp2_ext.common.log: level from the environment; the C++ core's messages reach the Python logger."""

from __future__ import annotations

import os
import subprocess
import sys


def test_log_level_from_environment():
    code = "import fsdp2_ext.common.log as log; log.info('visible-line')"
    for level, visible in (("info", True), ("error", False)):
        result = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env=dict(os.environ, FSDP2_EXT_LOG_LEVEL=level),
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        assert ("visible-line" in result.stderr) == visible


def test_cpp_messages_reach_the_python_logger():
    code = (
        "import logging, io\n"
        "stream = io.StringIO()\n"
        "logging.basicConfig(stream=stream, level=logging.INFO, format='%(name)s|%(message)s')\n"
        "import fsdp2_ext\n"
        "from fsdp2_ext import _fsdp2_ext\n"
        "_fsdp2_ext.log(_fsdp2_ext.LogLevel.INFO, 'from-cpp')\n"
        "fsdp2_ext.common.log.info('from-python')\n"
        "print(stream.getvalue())\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    # The application's handler (on the root logger) sees both; the fallback printer stays quiet.
    assert "fsdp2_ext|from-cpp" in result.stdout and "fsdp2_ext|from-python" in result.stdout
    assert "from-cpp" not in result.stderr
