"""A checkpoint trained with `pretrain_gpt.py --mock-data` (NullTokenizer, default vocabulary, no
--vocab-size given) is served by `python -m megatron.scope serve --load DIR`: the vocabulary comes
from the checkpoint, a disagreeing --vocab-size is an error naming both sizes, prompts are token
ids, and a text prompt is answered with an error frame that says so."""
from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time

import pytest

from launch import ROOT, torchrun
from scope_helpers import ctrl_c_reaches_child, fresh_job_env

aiohttp = pytest.importorskip("aiohttp", reason="the MegaScope server needs aiohttp (pip install aiohttp)")

TRAIN = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--train-iters", "2", "--lr", "1e-3", "--device", "cpu", "--mock-data"]


@pytest.fixture(scope="module")
def mock_checkpoint(tmp_path_factory):
    from megatron.app.tokenizer import MOCK_DEFAULT_VOCAB_SIZE

    root = str(tmp_path_factory.mktemp("mock") / "ckpt")
    # two data-parallel ranks: what a user's first `torchrun ... --mock-data --save` run looks like
    trained = torchrun(ROOT / "pretrain_gpt.py", [*TRAIN, "--save", root], nproc=2, timeout=300)
    assert trained.returncode == 0, trained.stderr[-3000:]
    return root, MOCK_DEFAULT_VOCAB_SIZE + 1


def test_loading_takes_the_vocabulary_from_the_checkpoint(mock_checkpoint):
    from megatron.app.tokenizer import NullTokenizer
    from megatron.scope import cli, loading

    root, vocab = mock_checkpoint
    _, saved_cfg, args = loading.read_checkpoint_header(root)
    assert args["vocab_size"] is None and args["tokenizer_type"] is None and saved_cfg["vocab_size"] == vocab
    tokenizer = loading.tokenizer_from_args(args, {"vocab_size": vocab - 1}, model_vocab_size=vocab, source=root)
    assert isinstance(tokenizer, NullTokenizer) and tokenizer.vocab_size == vocab
    with pytest.raises(loading.ModelLoadError) as wrong:
        loading.tokenizer_from_args(args, {"vocab_size": 100}, model_vocab_size=vocab, source=root)
    assert "--vocab-size 100" in str(wrong.value) and f"--vocab-size {vocab - 1}" in str(wrong.value)
    with pytest.raises(loading.ModelLoadError, match=f"257 ids.*vocabulary of {vocab}"):
        loading.tokenizer_from_args(args, {"tokenizer_type": "ByteLevelTokenizer"}, model_vocab_size=vocab)

    # The serve command's own loader, then one generation on it.
    from megatron.scope.engine import Coordinator, GenerateRequest, Generator, PromptError

    model = cli.load_model(cli.build_parser().parse_args(["serve", "--load", root]))
    assert isinstance(model.tokenizer, NullTokenizer) and model.runner.info.vocab_size == vocab
    generator = Generator(Coordinator(model.runner), model.tokenizer, model.tokenizer.vocab_size)
    summary = generator.generate(GenerateRequest(prompts=["1 2 3"], max_new_tokens=3), lambda *a: None)
    assert summary["steps"] == 3 and len(summary["tokens"][0]) == 6
    assert all(0 <= t < vocab for t, _ in summary["tokens"][0])
    for prompt in ("Hello", f"1 {vocab}", "-1"):
        with pytest.raises(PromptError, match=f"token ids separated by spaces, each in 0..{vocab - 1}"):
            generator.generate(GenerateRequest(prompts=[prompt], max_new_tokens=1), lambda *a: None)


def test_serve_command_on_a_mock_data_checkpoint(mock_checkpoint):
    root, vocab = mock_checkpoint
    wrong = subprocess.run([sys.executable, "-m", "megatron.scope", "serve", "--load", root, "--vocab-size", "100",
                            "--port", "0"], cwd=ROOT, env=fresh_job_env(), capture_output=True, text=True,
                           timeout=120)
    assert wrong.returncode == 2, wrong.stderr[-3000:]
    assert "--vocab-size 100 disagrees" in wrong.stderr and f"--vocab-size {vocab - 1}" in wrong.stderr
    assert "Traceback" not in wrong.stderr

    process = subprocess.Popen([sys.executable, "-m", "megatron.scope", "serve", "--load", root, "--port", "0",
                                "--token", "secret-token"], cwd=ROOT, env=fresh_job_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, preexec_fn=ctrl_c_reaches_child)
    output: list[str] = []
    try:
        deadline, url = time.monotonic() + 120, None
        while url is None and time.monotonic() < deadline:
            line = process.stdout.readline()
            assert line, "serve exited without printing its URL:\n" + "".join(output)
            output.append(line)
            match = re.search(r"open http://127\.0\.0\.1:(\d+)/", line)
            url = f"ws://127.0.0.1:{match.group(1)}/ws?token=secret-token" if match else None
        assert url, "no URL printed"
        # Read through the same buffered pipe (communicate() would skip what readline() buffered).
        output.append(process.stdout.readline())
        assert "note: this model was trained with NullTokenizer" in output[-1], "".join(output)
        assert "token ids separated by spaces, each in 0.." in output[-1]

        async def drive():
            async with aiohttp.ClientSession() as session:
                async with session.ws_connect(url) as ws:
                    hello = json.loads((await asyncio.wait_for(ws.receive(), 30)).data)
                    assert hello["model"]["vocab_size"] == vocab and "token ids" in hello["prompt_format"]
                    await ws.send_str(json.dumps({"type": "generate", "prompts": ["Hello"], "max_new_tokens": 2}))
                    error = await _next_json(ws)
                    assert error["type"] == "error" and error["code"] == "bad_prompt", error
                    assert "token ids separated by spaces" in error["message"]
                    await ws.send_str(json.dumps({"type": "generate", "prompts": ["5 6 7"], "max_new_tokens": 2}))
                    while (message := await _next_json(ws))["type"] != "done":
                        assert message["type"] == "start", message
                    assert message["steps"] == 2 and message["texts"][0].startswith("5 6 7 ")

        asyncio.run(asyncio.wait_for(drive(), 90))
        process.send_signal(signal.SIGINT)
        rest, _ = process.communicate(timeout=60)
        output.append(rest)
        assert process.returncode == 0, "".join(output)
        assert "Traceback" not in "".join(output)  # the text prompt was answered, not logged as a failure
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


async def _next_json(ws) -> dict:
    while True:  # skip the binary step frames
        message = await asyncio.wait_for(ws.receive(), 30)
        if message.type == aiohttp.WSMsgType.TEXT:
            return json.loads(message.data)
        assert message.type == aiohttp.WSMsgType.BINARY, message
