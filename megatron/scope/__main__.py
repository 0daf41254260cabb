"""Entry point: `python -m megatron.scope serve --load CKPT`."""
import sys

from megatron.scope.cli import main

sys.exit(main())
