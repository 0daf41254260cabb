"""`python -m megatron.scope serve`: prints the URL with its token, serves the page and /ws on one
port, exits cleanly on Ctrl-C; with no model and no demo checkpoint it says what to do."""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from launch import ROOT
from scope_helpers import ctrl_c_reaches_child, fresh_job_env

pytest.importorskip("aiohttp", reason="the MegaScope server needs aiohttp (pip install aiohttp)")


def test_serve_prints_url_serves_and_stops_on_ctrl_c():
    process = subprocess.Popen([sys.executable, "-m", "megatron.scope", "serve", "--random-model", "--port", "0",
                                "--num-layers", "2", "--hidden-size", "32"], cwd=ROOT, env=fresh_job_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               preexec_fn=ctrl_c_reaches_child)
    try:
        deadline, url = time.monotonic() + 120, None
        while url is None and time.monotonic() < deadline:
            line = process.stdout.readline()
            match = re.search(r"open (http://127\.0\.0\.1:\d+/\?token=\S{16,})", line)
            url = match.group(1) if match else url
            assert line or url, "serve exited without printing its URL"
        assert url, "no URL printed"
        with urllib.request.urlopen(url.split("?")[0], timeout=10) as page:
            assert page.status == 200 and b"MegaScope" in page.read()
        request = urllib.request.Request(url.split("?")[0] + "ws")  # no token: refused before upgrade
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 403
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=60)
        assert process.returncode == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_serve_without_a_model_says_how_to_get_one(tmp_path):
    env = fresh_job_env()
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-m", "megatron.scope", "serve"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "bash run_single.sh" in done.stderr and "--random-model" in done.stderr
