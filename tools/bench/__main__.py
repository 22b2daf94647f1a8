"""``python -m tools.bench``: run the decode benchmark CLI (from the repository root or with it on PYTHONPATH)."""
import sys

from .cli import main

sys.exit(main())
