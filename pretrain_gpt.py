"""Pretrain megatron-core's GPTModel with TP x PP x DP: `torchrun --nproc-per-node N pretrain_gpt.py ...`."""
import sys

from megatron.app.train import main

if __name__ == "__main__":
    sys.exit(main())
