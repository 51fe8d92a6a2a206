import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("OPTSTATE_BUILD_DIR", REPO / "build"))


@pytest.fixture(scope="session")
def optstate_cli():
    exe = BUILD / "optstate"
    if not exe.exists():
        pytest.fail(f"{exe} is not built; run scripts/setup.sh")

    def run(*args, check=True):
        proc = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True)
        if check and proc.returncode != 0:
            raise AssertionError(f"optstate {' '.join(map(str, args))} failed ({proc.returncode}): {proc.stderr}")
        return proc

    return run
