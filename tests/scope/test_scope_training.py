"""Training mode: pretrain_gpt.py --training-ws-port on two pipeline stages; the UI steps it
while paused, receives loss, per-layer gradient norms and the sample's internals, generates
while paused, perturbs training, then lets it run to the end."""
from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

aiohttp = pytest.importorskip("aiohttp", reason="the MegaScope server needs aiohttp (pip install aiohttp)")

from scope_helpers import ctrl_c_reaches_child, fresh_job_env  # noqa: E402
from launch import ROOT, env, free_port  # noqa: E402
from megatron.scope.codec import decode_frame  # noqa: E402
from megatron.scope.server import WEB_DIST  # noqa: E402

ARTIFACTS = Path(__file__).parent / "artifacts"


def _browser_ready() -> bool:
    return (Path("/usr/bin/chromium").exists() and shutil.which("node") is not None
            and (WEB_DIST / "index.html").is_file() and (WEB_DIST.parent / "node_modules" / "playwright-core").is_dir())

ARGS = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--train-iters", "4", "--lr", "1e-3", "--device", "cpu", "--mock-data",
        "--tokenizer-type", "ByteLevelTokenizer", "--pipeline-model-parallel-size", "2",
        "--training-ws-port", "0", "--ws-start-paused", "--ws-token", "train-token"]


def _launch():
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), "pretrain_gpt.py", *ARGS]
    return subprocess.Popen(command, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for_url(process, timeout: float = 150, pattern: str = r"open (http://\S+)") -> str:
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        seen.append(line)
        match = re.search(pattern, line)
        if match:
            return match.group(match.lastindex or 0)
    raise AssertionError(f"no line matching {pattern!r} printed:\n" + "".join(seen[-40:]))


async def _next(ws, wanted: set[str], timeout: float = 60):
    while True:
        message = await asyncio.wait_for(ws.receive(), timeout)
        if message.type == aiohttp.WSMsgType.BINARY:
            header, arrays = decode_frame(message.data)
            if "step" in wanted:
                return header, arrays
            continue
        data = json.loads(message.data)
        if data["type"] in wanted:
            return data


def test_training_mode_pause_step_generate_and_finish():
    process = _launch()
    try:
        url = _wait_for_url(process)
        port = int(re.search(r":(\d+)/", url).group(1))

        async def drive():
            async with aiohttp.ClientSession() as session:
                async with session.ws_connect(f"ws://127.0.0.1:{port}/ws?token=train-token") as ws:
                    hello = await _next(ws, {"hello"})
                    assert hello["mode"] == "train" and hello["training"]["paused"] is True
                    assert hello["model"]["pp"] == 2
                    await ws.send_str(json.dumps({"type": "train", "action": "step", "sample": "watch me"}))
                    metrics = await _next(ws, {"train_metrics"})
                    point = metrics["point"]
                    assert point["iteration"] == 1 and point["loss"] > 0
                    assert len(point["layer_grad_norms"]) == 4 and all(n > 0 for n in point["layer_grad_norms"])
                    header, arrays = await _next(ws, {"step"})
                    assert header["iteration"] == 1 and arrays["layer"].shape[:3] == (4, 1, len("watch me"))
                    assert arrays["attention"].shape == (4, 1, 4, 8, 8)
                    # generation while paused runs through both pipeline stages
                    await ws.send_str(json.dumps({"type": "generate", "id": 4, "prompts": ["ab"], "max_new_tokens": 2,
                                                  "capture": ["layer"]}))
                    done = await _next(ws, {"done"})
                    while done["request"] != 4:
                        done = await _next(ws, {"done"})
                    assert done["steps"] == 2
                    # a perturbed training step: gradients still flow
                    await ws.send_str(json.dumps({"type": "train", "action": "step", "perturbations": [
                        {"kind": "calculation", "type": "gaussian", "intensity": 0.5, "layers": [1]}]}))
                    metrics = await _next(ws, {"train_metrics"})
                    point = metrics["point"]
                    assert point["iteration"] == 2 and all(n > 0 for n in point["layer_grad_norms"])
                    if _browser_ready():  # the training tab in a real browser steps iteration 3
                        browser = await asyncio.to_thread(
                            subprocess.run, ["node", "e2e/training.e2e.mjs", url, str(ARTIFACTS), "3"],
                            cwd=WEB_DIST.parent, capture_output=True, text=True, timeout=120)
                        assert '"ok":true' in browser.stdout, browser.stdout[-2000:] + browser.stderr[-2000:]
                        metrics = await _next(ws, {"train_metrics"})
                        assert metrics["point"]["iteration"] == 3
                    await ws.send_str(json.dumps({"type": "train", "action": "start", "perturbations": []}))
                    last = metrics
                    while last["point"]["iteration"] < 4:
                        last = await _next(ws, {"train_metrics"})
        asyncio.run(asyncio.wait_for(drive(), 240))
        output, _ = process.communicate(timeout=120)
        assert process.returncode == 0, output[-3000:]
        assert re.search(r"iteration\s+4/\s+4 \|", output), output[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_enable_ws_server_serves_generation_after_training():
    import signal

    command = [sys.executable, "pretrain_gpt.py", *ARGS[:ARGS.index("--pipeline-model-parallel-size")],
               "--train-iters", "2", "--enable-ws-server", "--training-ws-port", "0", "--ws-token", "after"]
    process = subprocess.Popen(command, cwd=ROOT, env=fresh_job_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               preexec_fn=ctrl_c_reaches_child)
    try:
        port = int(re.search(r":(\d+)/", _wait_for_url(process)).group(1))
        _wait_for_url(process, pattern=r"training done; serving generation")

        async def drive():
            async with aiohttp.ClientSession() as session:
                async with session.ws_connect(f"ws://127.0.0.1:{port}/ws?token=after") as ws:
                    await _next(ws, {"hello"})
                    await ws.send_str(json.dumps({"type": "generate", "id": 9, "prompts": ["hi"], "max_new_tokens": 3}))
                    done = await _next(ws, {"done"})
                    assert done["request"] == 9 and done["steps"] == 3
        asyncio.run(asyncio.wait_for(drive(), 120))
        process.send_signal(signal.SIGINT)  # Ctrl-C ends serving; the trainer exits cleanly
        output, _ = process.communicate(timeout=60)
        assert process.returncode == 0, output[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_bad_scope_flags_fail_up_front():
    bad = subprocess.run([sys.executable, "pretrain_gpt.py", "--mock-data", "--device", "cpu",
                          "--training-ws-port", "70000"], cwd=ROOT, env=fresh_job_env(), capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "--training-ws-port 70000 is not a TCP port" in bad.stderr
