"""Make the collection importable as ansible_collections.sparkops.glm53 from a checkout."""
import sys
from pathlib import Path

_COLLECTIONS = Path(__file__).resolve().parent.parent / ".collections"
if str(_COLLECTIONS) not in sys.path:
    sys.path.insert(0, str(_COLLECTIONS))
