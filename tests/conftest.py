import sys
from pathlib import Path

# Tests import the checkout's packages (megatron.app, ...) and the helpers in tests/.
ROOT = Path(__file__).resolve().parents[1]
for path in (str(ROOT), str(ROOT / "tests")):
    if path not in sys.path:
        sys.path.insert(0, path)
