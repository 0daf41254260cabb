"""The built web app in Debian's chromium (playwright-core): generate, heatmaps, top-k,
attention layer/head, PCA, logit lens, a perturbation. Screenshots go to tests/scope/artifacts/."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser  # chromium drives the built web app

pytest.importorskip("aiohttp", reason="the MegaScope server needs aiohttp (pip install aiohttp)")

from megatron.scope.server import WEB_DIST, ServerConfig
from megatron.scope.service import ScopeService

WEB = WEB_DIST.parent
ARTIFACTS = Path(__file__).parent / "artifacts"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")


def _missing() -> str | None:
    if not Path(CHROMIUM).exists():
        return f"{CHROMIUM} is absent (apt-get install -y chromium; scripts/run_tests.sh installs it as root)"
    if shutil.which("node") is None:
        return "node is not installed"
    if not (WEB / "node_modules" / "playwright-core").is_dir():
        return f"web dependencies not installed (npm --prefix {WEB} ci)"
    if not (WEB_DIST / "index.html").is_file():
        return f"the shipped web app is missing from {WEB_DIST} (python -m megatron.scope build-web)"
    return None


@pytest.mark.skipif(_missing() is not None, reason=_missing() or "")
def test_browser_end_to_end(generator):
    service = ScopeService(generator, ServerConfig(port=0))
    url = service.start()
    worker = threading.Thread(target=service.serve_forever, daemon=True)
    worker.start()
    try:
        run = subprocess.run(["node", "e2e/scope.e2e.mjs", url, str(ARTIFACTS)], cwd=WEB, capture_output=True,
                             text=True, timeout=150)
    finally:
        service.close()
        worker.join(5)
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no result from the browser run:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}"
    result = json.loads(lines[-1])
    assert result["ok"], json.dumps(result, indent=1) + run.stderr[-2000:]
    for name in ("vectors", "attention", "pca", "logit-lens", "perturbed"):
        shot = ARTIFACTS / f"{name}.png"
        assert shot.is_file() and shot.stat().st_size > 10_000, f"screenshot {shot} missing or empty"
