"""One parse of the flags into typed sections: every section field comes from the flag of the same
name or is derived in one named place, and each default is written once (in the section)."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from megatron.app.arguments import _DERIVED, build_parser, config_from_args, section_defaults

ARGUMENTS = Path(__file__).resolve().parents[2] / "megatron" / "app" / "arguments.py"


def test_every_section_field_has_its_flag_or_is_derived():
    dests = {action.dest for action in build_parser([])._actions}
    unset = [f"{section.__name__}.{item.name}" for section, derived in _DERIVED.items()
             for item in dataclasses.fields(section) if item.name not in derived and item.name not in dests]
    assert not unset, f"fields no flag sets and nothing derives: {unset}"


def test_flag_defaults_are_the_sections_and_are_not_written_twice():
    parser = build_parser([])
    defaults = section_defaults()
    for action in parser._actions:
        if action.dest in defaults:
            assert action.default == defaults[action.dest], action.dest
    mirrored = {f"--{dest.replace('_', '-')}" for dest in defaults}
    twice = []
    for node in ast.walk(ast.parse(ARGUMENTS.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            flags = {arg.value for arg in node.args if isinstance(arg, ast.Constant)}
            if flags & mirrored and any(keyword.arg == "default" for keyword in node.keywords):
                twice.append(sorted(flags & mirrored)[0])
    assert not twice, f"defaults written in arguments.py as well as in the config section: {twice}"


def test_the_sections_carry_the_flags_given():
    args = build_parser([]).parse_args(
        ["--num-layers", "6", "--lr", "0.01", "--micro-batch-size", "2", "--seq-length", "64", "--mock-data",
         "--split", "90,5,5", "--save", "ckpt", "--log-throughput", "--swiglu", "--train-samples", "80",
         "--global-batch-size", "16", "--disable-bias-linear"])
    cfg = config_from_args(args, world_size=2)
    assert (cfg.model.num_layers, cfg.optimizer.lr, cfg.model.swiglu, cfg.model.add_bias_linear) == (6, 0.01, True, False)
    assert (cfg.training.train_iters, cfg.checkpoint.save, cfg.logging.log_throughput) == (5, "ckpt", True)
    assert (cfg.data.split, cfg.data.mock_data, cfg.data.seq_length, cfg.data.micro_batch_size) == ("90,5,5", True, 64, 2)
    assert cfg.model.max_position_embeddings == 64 and cfg.parallel.world_size == 2
