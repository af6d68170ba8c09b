import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_suite_without_matplotlib_says_how_to_install_it():
    hide_matplotlib = "import sys; sys.modules['matplotlib'] = None; import bench.suite"
    done = subprocess.run([sys.executable, "-c", hide_matplotlib], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 1
    assert "matplotlib, which is not installed" in done.stderr
    assert "pip install -e '.[bench]'" in done.stderr and "Traceback" not in done.stderr
