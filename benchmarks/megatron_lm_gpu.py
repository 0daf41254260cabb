"""One GPU session against Megatron-LM itself: its unmodified pretrain_gpt.py traced zero-code by
`python -m megatron.scan launch`, this trainer's speed beside it on the same model, and the CUDA
paths tested on CPU only so far. Stages run in priority order within a time budget; each stage's
outcome (figures, pass/fail, the end of its log) goes to OUT/summary.json and OUT/report.md,
every log to OUT/session.log, the traced run's detection to OUT/detect.txt and its trace to
OUT/mlm_trace.tar.gz.

    python benchmarks/megatron_lm_gpu.py --megatron-lm CHECKOUT --out OUT [--budget-s 500]

CHECKOUT is a Megatron-LM checkout at the tag of the megatron-core in use (core_v0.16.1 for
0.16.1; pretrain_gpt.py, gpt_builders.py, model_provider.py and megatron/), run as it is: from its
own directory, on mock data, with the local (no Transformer Engine) layer spec both can use.
benchmarks/megatron_lm_gpu_prepare.sh makes it, and the wheels a GPU machine without network needs.
`--only a,b` runs the named stages; `--device cpu` runs this trainer's stages on CPU (a dry run of
the plumbing: Megatron-LM's stages then fail with its "Megatron requires CUDA").
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # megatron.scan for reading the trace, wherever megatron-core is installed
ITER_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)(.*)")
TFLOPS = re.compile(r"throughput per GPU \(TFLOP/s/GPU\): ([0-9.]+)")
LOSS = re.compile(r"lm loss: ([0-9.Ee+-]+)")

# (layers, hidden, heads, seq, micro batch, global batch, iterations, warm-up iterations not timed)
MODELS = {
    "12x768": dict(layers=12, hidden=768, heads=12, seq=1024, mbs=4, gbs=32, iters=20, warmup=6),
    "24x2048": dict(layers=24, hidden=2048, heads=16, seq=2048, mbs=2, gbs=16, iters=12, warmup=4),
}
VOCAB = 50257


def model_args(m: dict, iters: int | None = None) -> list[str]:
    """Megatron-LM flags both scripts read the same way."""
    return ["--num-layers", str(m["layers"]), "--hidden-size", str(m["hidden"]), "--num-attention-heads",
            str(m["heads"]), "--seq-length", str(m["seq"]), "--max-position-embeddings", str(m["seq"]),
            "--micro-batch-size", str(m["mbs"]), "--global-batch-size", str(m["gbs"]),
            "--train-iters", str(iters or m["iters"]), "--lr", "1.0e-4", "--min-lr", "1.0e-5",
            "--lr-decay-style", "cosine", "--weight-decay", "0.1", "--clip-grad", "1.0", "--bf16",
            "--mock-data", "--vocab-size", str(VOCAB), "--log-interval", "1", "--log-throughput",
            "--transformer-impl", "local", "--seed", "1234"]


THEIRS = ["--tokenizer-type", "NullTokenizer", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm", "--no-masked-softmax-fusion", "--eval-iters", "0",
          "--eval-interval", "1000000", "--distributed-backend", "nccl"]


@dataclass
class Result:
    stage: str
    ok: bool = False
    seconds: float = 0.0
    figures: dict = field(default_factory=dict)
    note: str = ""
    tail: str = ""


class Session:
    def __init__(self, args) -> None:
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log = open(self.out / "session.log", "a")
        self.deadline = time.monotonic() + args.budget_s
        self.results: list[Result] = []
        self.mlm = Path(args.megatron_lm).resolve() if args.megatron_lm else None
        self.work = Path(tempfile.mkdtemp(prefix="mlm_gpu_"))
        self.port = 29600

    # --- running ----------------------------------------------------------------------------------
    def env(self, extra: dict | None = None) -> dict:
        paths = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        return dict(os.environ, PYTHONPATH=os.pathsep.join(dict.fromkeys(paths)), PYTHONUNBUFFERED="1",
                    CUDA_DEVICE_MAX_CONNECTIONS="1", **(extra or {}))

    def next_port(self) -> str:
        self.port += 1
        return str(self.port)

    def run(self, name: str, command: list[str], *, cwd: Path = ROOT, timeout: float = 300,
            env: dict | None = None) -> tuple[int, str]:
        left = self.deadline - time.monotonic()
        timeout = max(1.0, min(timeout, left))
        started = time.monotonic()
        self.log.write(f"\n===== {name} ({time.strftime('%H:%M:%S')}): {' '.join(command)}\n")
        self.log.flush()
        try:
            proc = subprocess.run(command, cwd=cwd, env=env or self.env(), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, timeout=timeout)
            code, text = proc.returncode, proc.stdout
        except subprocess.TimeoutExpired as exc:
            code = 124
            text = (exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or "")
            text += f"\n[driver] stopped after {timeout:.0f} s"
        self.log.write(_trim(text, 60000))
        self.log.write(f"\n===== {name}: exit {code} after {time.monotonic() - started:.1f} s\n")
        self.log.flush()
        print(f"[{time.strftime('%H:%M:%S')}] {name}: exit {code} ({time.monotonic() - started:.0f} s)", flush=True)
        return code, text

    def stage(self, name: str, fn, minimum_s: float) -> None:
        if self.args.only and name not in self.args.only:
            return
        if self.deadline - time.monotonic() < minimum_s:
            self.results.append(Result(name, note=f"not run: under {minimum_s:.0f} s of the budget left"))
            print(f"[driver] {name}: skipped (time)", flush=True)
            return
        started = time.monotonic()
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - one stage's failure must not stop the session
            result = Result(name, note=f"driver error: {exc!r}")
        result.stage, result.seconds = name, round(time.monotonic() - started, 1)
        self.results.append(result)
        self.write()

    def write(self) -> None:
        (self.out / "summary.json").write_text(json.dumps([r.__dict__ for r in self.results], indent=1))
        (self.out / "report.md").write_text(report(self.results, self.args))

    # --- training runs --------------------------------------------------------------------------------
    def torchrun(self, script: str, cwd: Path) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port",
                self.next_port(), script]

    def theirs(self, model: str, traced: bool = False) -> Result:
        m = MODELS[model]
        command = self.torchrun("pretrain_gpt.py", self.mlm) + model_args(m) + THEIRS
        trace = self.work / f"trace_{model}"
        if traced:
            command = [sys.executable, "-m", "megatron.scan", "launch", "--trace-dir", str(trace), "--"] + command
        code, text = self.run(f"megatron-lm {model}{' traced' if traced else ''}", command, cwd=self.mlm,
                              timeout=180, env=self.env(self.make_shim()))
        result = training_result(code, text, m)
        if traced and trace.is_dir():
            result.figures.update(self.trace_checks(trace))
        return result

    def ours(self, model: str, extra: list[str], iters: int | None = None, timeout: float = 240) -> Result:
        m = MODELS[model]
        command = self.torchrun("pretrain_gpt.py", ROOT) + model_args(m, iters) + ["--device", self.args.device,
                                                                                   "--eval-interval", "0", *extra]
        code, text = self.run(f"ours {model} {' '.join(extra)}", command, timeout=timeout)
        return training_result(code, text, m)

    def make_shim(self) -> dict:
        """Megatron-LM compiles its dataset helpers with `make` at start-up; the checkout carries the
        helper built from the same source (megatron-core's wheel), so where this machine has no
        working make, one that does nothing stands in (recorded in the log)."""
        datasets = self.mlm / "megatron" / "core" / "datasets"
        ok = shutil.which("make") and subprocess.run(["make", "-C", str(datasets)], capture_output=True).returncode == 0
        if ok:
            return {}
        shim = self.work / "shim"
        shim.mkdir(exist_ok=True)
        (shim / "make").write_text("#!/bin/sh\nexit 0\n")
        (shim / "make").chmod(0o755)
        self.log.write(f"\n[driver] no working make here: {datasets} keeps its prebuilt helper\n")
        return {"PATH": f"{shim}{os.pathsep}{os.environ.get('PATH', '')}"}

    def trace_checks(self, trace: Path) -> dict:
        """What the launched run recorded: spans and their clock, collectives and their backend, the
        watchdog's files, and aggregation with detection (scripts/aggregate.py -b DIR -d)."""
        from megatron.scan.trace_format import FLAG_DEVICE_TIME, iter_trace_files, read_rank_file

        figures: dict = {"trace_files": [p.name for p in sorted(trace.iterdir())]}
        for path in iter_trace_files(trace):
            rank = read_rank_file(path)
            names = rank.names
            kinds: dict[str, list[int]] = {}
            for name_id, flags in zip(rank.columns["name"].tolist(), rank.columns["flags"].tolist()):
                entry = kinds.setdefault(names[name_id], [0, 0])
                entry[0] += 1
                entry[1] += bool(flags & FLAG_DEVICE_TIME)
            figures[f"rank{rank.rank}"] = {"timing": rank.header.get("timing"), "backend": rank.header.get("backend"),
                                           "granularity": rank.header.get("trace", {}).get("granularity"),
                                           "windows": len(rank.windows), "events [count, device-timed]": kinds}
        code, text = self.run("aggregate -d", [sys.executable, "scripts/aggregate.py", "-b", str(trace), "-d"],
                              timeout=120)
        (self.out / "detect.txt").write_text(text)
        figures["aggregate_exit"] = code
        figures["verdict"] = next((line.strip() for line in text.splitlines() if "verdict" in line), "")
        with tarfile.open(self.out / "mlm_trace.tar.gz", "w:gz") as tar:
            tar.add(trace, arcname="mlm_trace")
        return figures

    def features(self) -> Result:
        """Megatron-LM features tested on CPU only, through megatron-core's CUDA optimizer and DDP
        buffers; and straggler mitigation's CUDA-event clock. Run side by side (correctness only)."""
        small = dict(layers=4, hidden=256, heads=8, seq=256, mbs=2, gbs=8, iters=12, warmup=0)
        if self.args.device == "cpu":
            small.update(hidden=64, heads=4, seq=64, iters=6)
        runs = {
            "--fp16": ["--fp16"],
            "--use-distributed-optimizer": ["--use-distributed-optimizer"],
            "--decoupled-lr": ["--decoupled-lr", "3e-4", "--decoupled-min-lr", "3e-5"],
            "--calculate-per-token-loss": ["--calculate-per-token-loss"],
            "--straggler-mitigation --trace": ["--straggler-mitigation", "--trace",
                                               "--trace-dir", str(self.work / "mitigation_trace")],
        }

        def one(flags: list[str]) -> tuple[int, str]:
            args = model_args(small)
            if "--fp16" in flags:
                args.remove("--bf16")
            command = self.torchrun("pretrain_gpt.py", ROOT) + args + ["--device", self.args.device,
                                                                       "--eval-interval", "0", *flags]
            return self.run(f"feature {' '.join(flags)}", command, timeout=200)

        with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
            done = dict(zip(runs, pool.map(one, runs.values())))
        figures, tails = {}, []
        for name, (code, text) in done.items():
            losses = [float(x) for x in LOSS.findall(text)]
            finite = bool(losses) and all(x == x and x < 1e4 for x in losses)
            figures[name] = {"exit": code, "iterations": len(losses), "first_loss": losses[0] if losses else None,
                             "last_loss": losses[-1] if losses else None, "finite": finite}
            if code != 0 or not finite:
                tails.append(f"{name}: {_trim(text, 1500)}")
        ok = all(f["exit"] == 0 and f["finite"] and f["iterations"] == small["iters"] for f in figures.values())
        return Result("features", ok=ok, figures=figures, tail="\n".join(tails))

    def shm_ipc(self) -> Result:
        figures = {}
        code, text = self.run("shm build", [sys.executable, "setup.py", "build_ext", "--inplace"], timeout=180)
        figures["build_exit"] = code
        if code != 0:
            return Result("shm_ipc", figures=figures, tail=_trim(text, 3000))
        code, text = self.run("shm cuda ipc tests", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                                     "tests/shm_tensor_rdma/test_cuda_ipc.py"], timeout=240)
        figures["tests_exit"] = code
        figures["tests"] = (text.strip().splitlines() or [""])[-1]
        bench = self.out / "shm_cuda_ipc.json"
        code_b, text_b = self.run("shm cuda ipc benchmark", [sys.executable, "benchmarks/shm_cuda_ipc.py", "--json",
                                                             str(bench), "--max-size-mib", "64"], timeout=150)
        figures["bench_exit"] = code_b
        figures["bench"] = _trim(text_b, 2500)
        return Result("shm_ipc", ok=code == 0 and code_b == 0, figures=figures,
                      tail=_trim(text, 3000) if code else "")


def training_result(code: int, text: str, m: dict) -> Result:
    rows = [(int(i), float(ms), rest) for i, ms, rest in ITER_LINE.findall(text)]
    timed = [ms for i, ms, _ in rows if i > m["warmup"]]
    figures: dict = {"iterations_logged": len(rows)}
    if timed:
        ms = statistics.median(timed)
        tokens = m["gbs"] * m["seq"]
        figures.update(ms_per_iter=round(ms, 1), tokens_per_s=round(tokens / ms * 1e3),
                       model_tflops=round(model_flops(m) / ms / 1e9, 1), timed_iterations=len(timed))
        reported = [float(t) for i, _, rest in rows if i > m["warmup"] for t in TFLOPS.findall(rest)]
        if reported:
            figures["tflops_as_logged"] = round(statistics.median(reported), 1)
    losses = [float(x) for x in LOSS.findall(text)]
    if losses:
        figures["first_loss"], figures["last_loss"] = losses[0], losses[-1]
    ok = code == 0 and len(rows) == m["iters"]
    return Result("", ok=ok, figures=figures, tail="" if ok else _trim(text, 4000))


def model_flops(m: dict) -> float:
    """Model FLOPs of one iteration (forward + backward, no recomputation) of a GPT with a 4h MLP:
    6 x parameters-in-matmuls x tokens, plus attention scores and values (12 x L x s x h per token),
    the same formula for both scripts."""
    layers, hidden, seq = m["layers"], m["hidden"], m["seq"]
    tokens = m["gbs"] * seq
    matmul_params = layers * 12 * hidden * hidden + hidden * VOCAB
    return 6 * matmul_params * tokens + 12 * layers * seq * hidden * tokens


def report(results: list[Result], args) -> str:
    by = {r.stage: r for r in results}
    lines = [f"# megatron_lm_gpu session ({time.strftime('%Y-%m-%d %H:%M')})", ""]
    lines += ["| stage | ok | seconds | figures | note |", "| --- | --- | --- | --- | --- |"]
    for r in results:
        lines.append(f"| {r.stage} | {r.ok} | {r.seconds} | `{json.dumps(r.figures)[:600]}` | {r.note} |")
    lines += ["", "| model | run | ms/iter | tokens/s | TFLOP/s | vs Megatron-LM |", "| --- | --- | --- | --- | --- | --- |"]
    for model in MODELS:
        theirs = by.get(f"megatron-lm {model}")
        base = theirs.figures.get("ms_per_iter") if theirs else None
        for key in (f"megatron-lm {model}", f"megatron-lm {model} traced", f"ours {model} local",
                    f"ours {model} sdpa"):
            r = by.get(key)
            if r is None or "ms_per_iter" not in r.figures:
                continue
            f = r.figures
            ratio = f"{base / f['ms_per_iter']:.3f}x" if base else "-"
            lines.append(f"| {model} | {key} | {f['ms_per_iter']} | {f['tokens_per_s']} | {f['model_tflops']} | {ratio} |")
    for r in results:
        if r.tail:
            lines += ["", f"## {r.stage}: end of log", "```", r.tail, "```"]
    return "\n".join(lines) + "\n"


def _trim(text: str, limit: int) -> str:
    return text if len(text) <= limit else "...\n" + text[-limit:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-lm", required=True, help="Megatron-LM checkout (pretrain_gpt.py and megatron/)")
    parser.add_argument("--out", required=True, help="directory for summary.json, report.md and the logs")
    parser.add_argument("--budget-s", type=float, default=500, help="stop starting stages after this (default 500)")
    parser.add_argument("--only", type=lambda s: set(s.split(",")), default=None, help="stage names, comma-separated")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="device of this trainer's runs")
    args = parser.parse_args()
    if args.device == "cpu":  # a dry run of the plumbing: tiny models
        for m in MODELS.values():
            m.update(layers=2, hidden=64, heads=4, seq=64, mbs=2, gbs=4, iters=4, warmup=1)
    s = Session(args)
    print(f"[driver] {len(MODELS)} models; budget {args.budget_s:.0f} s; out {s.out}", flush=True)
    build = None
    if not args.only or "shm_ipc" in args.only:  # the extension builds on the CPU while the GPU trains
        build = subprocess.Popen([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=ROOT,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    s.stage("megatron-lm 12x768", lambda: s.theirs("12x768"), 60)
    s.stage("megatron-lm 12x768 traced", lambda: s.theirs("12x768", traced=True), 60)
    s.stage("ours 12x768 local", lambda: s.ours("12x768", ["--attention-backend", "local"]), 45)
    s.stage("ours 12x768 sdpa", lambda: s.ours("12x768", ["--attention-backend", "flash"]), 45)
    s.stage("megatron-lm 24x2048", lambda: s.theirs("24x2048"), 75)
    s.stage("ours 24x2048 local", lambda: s.ours("24x2048", ["--attention-backend", "local"]), 60)
    s.stage("ours 24x2048 sdpa", lambda: s.ours("24x2048", ["--attention-backend", "flash"]), 60)
    if build is not None:
        build.wait()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # correctness only: side by side
        ipc = pool.submit(s.stage, "shm_ipc", s.shm_ipc, 60)
        s.stage("features", s.features, 40)
        ipc.result()
    s.write()
    print((s.out / "report.md").read_text(), flush=True)


if __name__ == "__main__":
    main()
