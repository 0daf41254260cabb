"""Entry point of `python -m megatron.scan`."""
import sys

from megatron.scan.cli import main

sys.exit(main())
