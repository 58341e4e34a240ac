"""The end-to-end benchmark of agentic workflows on EMULATED resources: ``python benchmarks/e2e.py
--help``. The harness is the package ``benchmarks/e2e/`` (its ``__init__`` lists the modules);
methodology and results in ``benchmarks/README.md``."""

import os
import sys

# Run as a script: make the repository importable (the package benchmarks/e2e/ wins over this file).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.e2e.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
