"""The WebSocket protocol end to end with a real client: hello, streamed binary step frames,
PCA, stop, and every kind of bad input answered with an error frame while the server lives on."""
from __future__ import annotations

import asyncio
import json
import threading

import pytest

aiohttp = pytest.importorskip("aiohttp", reason="the MegaScope server needs aiohttp (pip install aiohttp)")
# noqa below: the server modules import aiohttp, so they come after the skip.

from megatron.scope.codec import decode_frame  # noqa: E402
from megatron.scope.server import ServerConfig  # noqa: E402
from megatron.scope.service import ScopeService  # noqa: E402


@pytest.fixture()
def service(generator, tmp_path):
    (tmp_path / "index.html").write_text("<!doctype html><title>MegaScope test</title>")
    (tmp_path / "assets").mkdir()
    (tmp_path / "assets" / "app.js").write_text("console.log(1)")
    svc = ScopeService(generator, ServerConfig(port=0, token="secret-token", static_dir=tmp_path,
                                               rate_per_second=50, rate_burst=50))
    svc.start()
    worker = threading.Thread(target=svc.serve_forever, daemon=True)
    worker.start()
    yield svc
    svc.close()
    worker.join(5)


def ws_url(svc, token="secret-token") -> str:
    return f"ws://127.0.0.1:{svc.server.port}/ws?token={token}"


async def receive_json(ws) -> dict:
    message = await asyncio.wait_for(ws.receive(), 20)
    assert message.type == aiohttp.WSMsgType.TEXT, message
    return json.loads(message.data)


async def collect_until_done(ws) -> tuple[list[dict], list[tuple[dict, dict]]]:
    texts, frames = [], []
    while True:
        message = await asyncio.wait_for(ws.receive(), 30)
        if message.type == aiohttp.WSMsgType.BINARY:
            frames.append(decode_frame(message.data))
            continue
        data = json.loads(message.data)
        texts.append(data)
        if data["type"] in ("done", "error"):
            return texts, frames


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_generate_streams_step_frames_then_done(service):
    async def go():
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(ws_url(service)) as ws:
                hello = await receive_json(ws)
                assert hello["type"] == "hello" and hello["model"]["num_layers"] == 3
                assert "layer" in hello["capture_kinds"] and 32 in hello["bins"]
                await ws.send_str(json.dumps({
                    "type": "generate", "id": 11, "prompts": ["Hello", "Hi"], "max_new_tokens": 4,
                    "capture": ["qkv", "attention", "fc1", "fc2", "layer"], "bins": 8, "reduce": "absmax",
                    "top_k": 3, "lens": True}))
                texts, frames = await collect_until_done(ws)
                assert [t["type"] for t in texts] == ["start", "done"]
                assert texts[-1]["request"] == 11 and texts[-1]["steps"] == 4 and texts[-1]["dropped"] == 0
                assert len(frames) == 4
                header, arrays = frames[0]
                assert header["type"] == "step" and header["step"] == 0
                assert arrays["qkv"].shape == (3, 2, 5, 8) and arrays["layer"].shape == (3, 2, 5, 8)
                assert arrays["attention"].shape == (3, 2, 4, 5, 5)
                assert arrays["lens_ids"].shape == (3, 2, 5, 3)
                assert all(str(i) in header["lens_vocab"] for i in arrays["lens_ids"].flatten().tolist())
                first = header["samples"][0]
                assert first["tokens"][0][1] == "H" and len(first["topk"]) == 3
                assert first["topk"][0][2] >= first["topk"][1][2]
                later, arrays = frames[1]
                assert later["positions"] == [[5], [2]] and arrays["attention"].shape == (3, 2, 4, 1, 6)
                # the sampled tokens of each step become the done message's text
                sampled = "".join(f[0]["samples"][0]["sampled"]["text"] for f in frames)
                assert texts[-1]["texts"][0] == "Hello" + sampled

                await ws.send_str(json.dumps({"type": "pca", "layer": 1}))
                pca = await receive_json(ws)
                assert pca["type"] == "pca" and len(pca["points"]) == len(pca["labels"]) == 5 + 2 + 3 * 2
                assert pca["explained"][0] >= pca["explained"][1] > 0
    run(go())


def test_stop_ends_a_long_generation_early(service):
    async def go():
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(ws_url(service)) as ws:
                await receive_json(ws)
                await ws.send_str(json.dumps({"type": "generate", "prompts": ["x"], "max_new_tokens": 60,
                                              "capture": ["attention", "layer"]}))
                await receive_json(ws)  # start
                await ws.send_str(json.dumps({"type": "stop"}))
                texts, frames = await collect_until_done(ws)
                assert texts[-1]["steps"] < 60
    run(go())


BAD_MESSAGES = [
    ("not json at all", "bad_request"),
    ("[1, 2, 3]", "bad_request"),
    (json.dumps({"type": "launch_missiles"}), "unknown_type"),
    (json.dumps({"type": "generate", "prompts": "a string"}), "bad_request"),
    (json.dumps({"type": "generate", "prompts": ["a"], "bins": 33}), "bad_request"),
    (json.dumps({"type": "generate", "prompts": ["a"], "reduce": "__import__('os').system('x')"}), "bad_request"),
    (json.dumps({"type": "generate", "prompts": ["a"], "capture": ["everything"]}), "bad_request"),
    (json.dumps({"type": "generate", "prompts": ["a"], "max_new_tokens": 10**9}), "bad_request"),
    (json.dumps({"type": "generate", "prompts": ["a"], "perturbations": [{"kind": "storage", "layers": [-1]}]}),
     "bad_perturbation"),
    (json.dumps({"type": "pca", "layer": 7}), "bad_request"),
    (json.dumps({"type": "train", "action": "start"}), "not_training"),
    ("[" * 100000, "too_large"),
    (json.dumps({"type": "ping", "extra": {"a": 1}}), "bad_request"),
]


def test_malformed_messages_get_error_frames_and_the_server_lives_on(service):
    async def go():
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(ws_url(service)) as ws:
                await receive_json(ws)
                for text, code in BAD_MESSAGES:
                    await ws.send_str(text)
                    error = await receive_json(ws)
                    assert error["type"] == "error" and error["code"] == code, (text[:80], error)
                await ws.send_bytes(b"\x00\x01binary")
                assert (await receive_json(ws))["type"] == "error"
                await ws.send_str(json.dumps({"type": "ping", "id": 5}))
                assert await receive_json(ws) == {"type": "pong", "id": 5}
                await ws.send_str(json.dumps({"type": "pca", "layer": 0}))
                error = await receive_json(ws)  # nothing generated yet on this server
                assert error["type"] == "error" and "generate" in error["message"]
    run(go())


def test_token_origin_and_rate_limits(service):
    async def go():
        async with aiohttp.ClientSession() as session:
            for url in (ws_url(service, "wrong"), f"ws://127.0.0.1:{service.server.port}/ws"):
                with pytest.raises(aiohttp.WSServerHandshakeError) as failure:
                    await session.ws_connect(url)
                assert failure.value.status == 403
            with pytest.raises(aiohttp.WSServerHandshakeError) as failure:
                await session.ws_connect(ws_url(service), headers={"Origin": "http://evil.example"})
            assert failure.value.status == 403
            origin = f"http://localhost:{service.server.port}"
            async with session.ws_connect(ws_url(service), headers={"Origin": origin}) as ws:
                await receive_json(ws)
                for index in range(80):
                    await ws.send_str(json.dumps({"type": "ping", "id": index}))
                replies = [await receive_json(ws) for _ in range(80)]
                codes = [r.get("code") for r in replies if r["type"] == "error"]
                assert codes and set(codes) == {"rate_limited"}
            async with session.get(f"http://127.0.0.1:{service.server.port}/") as page:
                assert page.status == 200 and "MegaScope test" in await page.text()
                assert "default-src 'self'" in page.headers["Content-Security-Policy"]
            async with session.get(f"http://127.0.0.1:{service.server.port}/assets/app.js") as asset:
                assert asset.status == 200
            async with session.get(f"http://127.0.0.1:{service.server.port}/assets/../../../etc/passwd") as escape:
                assert escape.status == 404
    run(go())


def test_bounded_outbox_drops_stale_step_frames_not_control_frames():
    from megatron.scope.server import _Client

    async def go():
        client = _Client(1, ws=None, limit=4, rate=1, burst=1)
        client.push("json", {"type": "start"}, False)
        for step in range(10):
            client.push("binary", step, True)
        client.push("json", {"type": "done"}, False)
        kept = [payload for _, payload, _ in client.outbox]
        assert kept[0] == {"type": "start"} and kept[-1] == {"type": "done"}
        assert kept[1:-1] == [8, 9] and client.dropped == 8  # newest views survive
    asyncio.run(go())
