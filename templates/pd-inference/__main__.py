"""This project's program: the pd-inference platform's own, from its checkout at platform/.

What flows through here: Pulumi runs this file for a stack of this project -> it puts
platform/ (the platform repository, a git submodule pinned to a release) first on the import
path and runs platform/__main__.py as the program. Config, resources and outputs are all the
platform's; this project only holds stack files.
"""

import runpy
import sys
from pathlib import Path

PLATFORM = Path(__file__).resolve().parent / "platform"
if not (PLATFORM / "__main__.py").is_file():
    raise SystemExit(f"{PLATFORM}: no platform checkout; run: git submodule update --init")
sys.path.insert(0, str(PLATFORM))
runpy.run_path(str(PLATFORM / "__main__.py"), run_name="__main__")
