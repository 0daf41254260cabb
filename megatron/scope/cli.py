"""`python -m megatron.scope serve ...`: load a model and serve the MegaScope app on one port.
Under torchrun with TP x PP ranks, global rank 0 serves and the other ranks follow it.
`python -m megatron.scope build-web [--check]`: rebuild the shipped web app (needs npm), or say
whether it matches its sources."""
from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:  # imported where used: build-web needs neither torch nor aiohttp
    from megatron.scope.server import ServerConfig

DEMO_CHECKPOINT = "outputs/checkpoints"


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("MegaScope server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind; the default keeps the server on this machine")
    g.add_argument("--port", type=int, default=8765, help="HTTP + WebSocket port (0 = any free port)")
    g.add_argument("--token", default=None, help="access token (default: a new random one per run)")
    g.add_argument("--allow-origin", action="append", default=[],
                   help="extra browser origin allowed to open the WebSocket (e.g. a dev server)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron.scope", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model for live inspection during generation")
    source = serve.add_mutually_exclusive_group()
    source.add_argument("--load", help="checkpoint directory written by pretrain_gpt.py --save "
                                       f"(default: {DEMO_CHECKPOINT}, the model `bash run_single.sh` trains)")
    source.add_argument("--hf-model", "--hf-gpt2", dest="hf_model", metavar="DIR",
                        help="local Hugging Face LlamaForCausalLM or GPT-2 directory (config.json, model.safetensors "
                             "or pytorch_model.bin, its tokenizer files); --hf-gpt2 is the older name")
    source.add_argument("--random-model", action="store_true", help="a freshly initialised model (demo/testing)")
    add_server_arguments(serve)
    g = serve.add_argument_group("layout (any TP x PP, whatever the checkpoint was saved with; launch "
                                 "TP x PP processes with torchrun) and --random-model's shape")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="ranks each layer is split over when serving (default %(default)s)")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="pipeline stages the layers are split into when serving (default %(default)s)")
    g.add_argument("--num-layers", type=int, default=4, help="--random-model: transformer layers (default %(default)s)")
    g.add_argument("--hidden-size", type=int, default=64, help="--random-model: hidden size (default %(default)s)")
    g.add_argument("--num-attention-heads", type=int, default=4,
                   help="--random-model: attention heads (default %(default)s)")
    g.add_argument("--max-position-embeddings", type=int, default=128,
                   help="--random-model: longest sequence in tokens (default %(default)s)")
    g.add_argument("--seed", type=int, default=1234,
                   help="--random-model: seed of its weights (default %(default)s)")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="cpu",
                   help="where the model runs: auto = cuda when torch sees a GPU (default %(default)s)")
    g = serve.add_argument_group("tokenizer (defaults: what the checkpoint was trained with)")
    g.add_argument("--tokenizer-type", default=None,
                   help="GPT2BPETokenizer, ByteLevelTokenizer or NullTokenizer (default: the checkpoint's)")
    g.add_argument("--vocab-file", default=None, help="GPT-2 BPE vocab.json (default: the checkpoint's)")
    g.add_argument("--merge-file", default=None, help="GPT-2 BPE merges.txt (default: the checkpoint's)")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="NullTokenizer's ids without eod, as pretrain_gpt.py's --vocab-size (default: the checkpoint's)")
    build = sub.add_parser("build-web", help="rebuild the shipped web app and its manifest (Node.js 20+ and npm); "
                                             "only needed after changing megatron/scope/web")
    build.add_argument("--check", action="store_true",
                       help="build nothing: exit 1 with what changed when the shipped build does not match its sources")
    return parser


def load_model(args: argparse.Namespace):
    from megatron.scope import loading

    if not (args.load or args.hf_model or args.random_model):
        if not os.path.isfile(os.path.join(DEMO_CHECKPOINT, "latest_checkpointed_iteration.txt")):
            raise loading.ModelLoadError(
                f"no model given and no demo checkpoint in {DEMO_CHECKPOINT}: train it with `bash run_single.sh`, "
                "or pass --load DIR, --hf-model DIR or --random-model")
        args.load = DEMO_CHECKPOINT
    if args.load:
        overrides = {"tokenizer_type": args.tokenizer_type, "vocab_file": args.vocab_file,
                     "merge_file": args.merge_file, "vocab_size": args.vocab_size}
        return loading.load_checkpoint(args.load, overrides, device=args.device, tp=args.tensor_model_parallel_size,
                                       pp=args.pipeline_model_parallel_size)
    if args.hf_model:
        from megatron.scope.hf import load_hf

        return load_hf(args.hf_model, tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                       device=args.device)
    from megatron.app.config import ModelConfig
    from megatron.app.tokenizer import ByteLevelTokenizer

    tokenizer = ByteLevelTokenizer() if args.tokenizer_type is None and args.vocab_size is None else \
        loading.tokenizer_from_args({}, {"tokenizer_type": args.tokenizer_type, "vocab_file": args.vocab_file,
                                         "merge_file": args.merge_file, "vocab_size": args.vocab_size})
    cfg = ModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                      num_attention_heads=args.num_attention_heads, seq_length=args.max_position_embeddings,
                      max_position_embeddings=args.max_position_embeddings)
    return loading.build_random(cfg, tokenizer, args.tensor_model_parallel_size,
                                args.pipeline_model_parallel_size, args.seed, args.device)


def server_config(args: argparse.Namespace) -> ServerConfig:
    from megatron.scope.server import ServerConfig

    config = ServerConfig(host=args.host, port=args.port, allowed_origins=tuple(args.allow_origin))
    if args.token:
        config.token = args.token
    return config


def serve(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from megatron.scope.engine import Coordinator, Generator, leave_process_group, prompt_format
    from megatron.scope.loading import ModelLoadError
    from megatron.scope.service import ScopeService

    try:
        model = load_model(args)
    except ModelLoadError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    coordinator = Coordinator(model.runner)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank != 0:
        coordinator.follow()  # returns on "exit"
        leave_process_group()
        return 0
    generator = Generator(coordinator, model.tokenizer, model.tokenizer.vocab_size)
    service = ScopeService(generator, server_config(args))
    url = service.start()
    info = model.runner.info
    print(f"MegaScope serving {info.name} ({info.num_layers} layers, hidden {info.hidden_size}, "
          f"tp={info.tp} pp={info.pp})\n  open {url}", flush=True)
    prompts = prompt_format(model.tokenizer, model.tokenizer.vocab_size)
    if prompts:
        print(f"  note: {prompts}", flush=True)
    try:
        service.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        coordinator.send("exit")
        service.close()
        leave_process_group()
    return 0


def build_web(args: argparse.Namespace) -> int:
    from megatron.scope import webapp

    if not webapp.source_ids():
        print(f"no web app sources in {webapp.WEB_DIR} (an installed package ships only the build)", file=sys.stderr)
        return 2
    if args.check:
        problems = webapp.check_build()
        if problems:
            print(webapp.stale_message(problems), file=sys.stderr, flush=True)
            return 1
        print(f"the shipped MegaScope build in {webapp.WEB_DIST} matches its sources", flush=True)
        return 0
    try:
        webapp.build_web()
    except webapp.WebBuildError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "build-web":
        return build_web(args)
    return 2
