"""Checkpoint integrity, end to end on CPU (2 ranks, PP=2, a tiny model): every checkpoint's
manifest.json records the size and sha256 of its files; a damaged file stops a --load run before
training, naming the file and the newest intact iteration to load with --ckpt-step; --ckpt-step of a
missing iteration lists those there are; a full disk during a save stops every rank with the
directory, the size needed and the space free, leaves the previous checkpoint the latest, and the
same command resumes from it."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from launch import torchrun
from logparse import losses

RUN = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
       "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "2e-3",
       "--min-lr", "1e-4", "--lr-warmup-iters", "1", "--log-interval", "1", "--device", "cpu",
       "--pipeline-model-parallel-size", "2", "--mock-data", "--vocab-size", "256", "--train-iters", "6"]
RANK_FILE = "mp_rank_00_{:03d}/model_optim_rng.pt"


def _train(args: list[str]) -> tuple[int, str]:
    proc = torchrun("pretrain_gpt.py", [*RUN, *args], nproc=2, timeout=180)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict[int, str]]:
    """Checkpoints at iterations 2, 4 and 6, and the run's losses."""
    root = tmp_path_factory.mktemp("saved") / "ckpt"
    code, out = _train(["--save", str(root), "--save-interval", "2"])
    assert code == 0, out[-3000:]
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000002", "iter_0000004", "iter_0000006",
                                                      "latest_checkpointed_iteration.txt"]
    return root, losses(out)


def _copy(saved_root: Path, tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    shutil.copytree(saved_root, root)
    return root


def test_manifest_records_every_file_with_its_sha256(saved):
    import hashlib

    root, _ = saved
    for directory in sorted(root.glob("iter_*")):
        manifest = json.loads((directory / "manifest.json").read_text())
        assert manifest["checksum"] == "sha256" and manifest["iteration"] == int(directory.name[5:])
        on_disk = {p.relative_to(directory).as_posix() for p in directory.rglob("*.pt")}
        assert set(manifest["files"]) == on_disk == {RANK_FILE.format(0), RANK_FILE.format(1)}
        for name, entry in manifest["files"].items():
            data = (directory / name).read_bytes()
            assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_truncated_file_stops_before_training_and_ckpt_step_resumes_from_the_intact_one(saved, tmp_path):
    saved_root, expected = saved
    root = _copy(saved_root, tmp_path)
    damaged = root / "iter_0000006" / RANK_FILE.format(1)
    with open(damaged, "r+b") as f:
        f.truncate(damaged.stat().st_size // 3)

    code, out = _train(["--load", str(root), "--save", str(root), "--train-iters", "8"])
    assert code != 0
    assert f"{damaged} is truncated:" in out, out[-3000:]
    assert f"the newest intact checkpoint in {root} is iteration 4: load it with --ckpt-step 4" in out
    assert "[rank 0] error: loading the checkpoint failed on rank 1" in out  # every rank stops with it
    assert "[rank 1] error:" in out
    assert "training:" not in out and not losses(out)  # stopped before training

    code, out = _train(["--load", str(root), "--save", str(root), "--ckpt-step", "4"])
    assert code == 0, out[-3000:]
    assert f"loaded checkpoint from {root} at iteration 4 (--ckpt-step 4)" in out
    resumed = losses(out)
    assert resumed == {5: expected[5], 6: expected[6]}  # the same curve as the uninterrupted run
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    assert (root / "iter_0000006" / "manifest.json").is_file()  # the damaged iteration was saved again


@pytest.mark.parametrize("damage", ["flip", "missing"])
def test_flipped_byte_or_missing_file_is_detected(saved, tmp_path, damage):
    saved_root, _ = saved
    root = _copy(saved_root, tmp_path)
    target = root / "iter_0000006" / RANK_FILE.format(0)
    if damage == "flip":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))  # same length
        wanted = f"{target} does not match its sha256 checksum"
    else:
        target.unlink()
        wanted = f"{target} is missing (its manifest.json lists it)"
    # an older checkpoint damaged too: the newest intact one is then iteration 2
    with open(root / "iter_0000004" / RANK_FILE.format(1), "ab") as f:
        f.write(b"\0")

    code, out = _train(["--load", str(root)])
    assert code != 0
    assert wanted in out, out[-3000:]
    assert (f"the newest intact checkpoint in {root} is iteration 2 (iter_0000004 damaged too): "
            "load it with --ckpt-step 2") in out
    assert not losses(out)


def test_ckpt_step_of_a_missing_iteration_lists_the_saved_ones(saved, tmp_path):
    saved_root, _ = saved
    code, out = _train(["--load", str(saved_root), "--ckpt-step", "5"])
    assert code != 0
    assert (f"--ckpt-step 5: --load {saved_root} holds no iteration 5 (no iter_0000005); it holds iterations "
            "2, 4, 6 (the latest, per latest_checkpointed_iteration.txt: 6)") in out, out[-3000:]
    assert not losses(out)


def test_checkpoint_without_manifest_still_loads(saved, tmp_path):
    saved_root, expected = saved
    root = _copy(saved_root, tmp_path)
    for manifest in root.glob("iter_*/manifest.json"):
        manifest.unlink()
    code, out = _train(["--load", str(root), "--ckpt-step", "4"])
    assert code == 0, out[-3000:]
    assert out.count(f"note: {root / 'iter_0000004'} has no manifest.json (saved before checksums were "
                     "recorded); loading it without verifying its files") == 1
    assert losses(out) == {5: expected[5], 6: expected[6]}


def _processes_naming(text: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline:
                found.append(f"{entry.name}: {cmdline[:200]}")
    return found


def test_disk_full_during_a_save_keeps_the_previous_checkpoint_and_the_same_command_resumes(saved, tmp_path):
    saved_root, expected = saved
    one = sum(p.stat().st_size for p in (saved_root / "iter_0000002").rglob("*") if p.is_file())
    mount = tmp_path / "small"
    mount.mkdir()
    # Room for one checkpoint, not for a second beside it.
    size_k = (one * 3 // 2) // 1024
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_k}k", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill (needs root / CAP_SYS_ADMIN): {made.stderr.strip()}")
    try:
        root = mount / "ckpt"
        command = ["--load", str(root), "--save", str(root), "--save-interval", "2"]
        code, out = _train(command)
        assert code != 0
        assert "saved checkpoint at iteration 2" in out, out[-3000:]
        for rank in (0, 1):
            assert f"[rank {rank}] error: saving the checkpoint of iteration 4 to {root} failed: the disk is full" in out
        assert "No space left on device" in out
        assert "the checkpoint needs about " in out and "(the previous one, iter_0000002, holds " in out
        assert f"were free on the filesystem of {root} when the save started" in out
        assert ("the partial iter_0000004.tmp/ was removed; latest_checkpointed_iteration.txt still names "
                "iteration 2: free space (or --save to a larger filesystem) and rerun the same command to "
                "resume from iteration 2") in out
        assert sorted(losses(out)) == [1, 2, 3, 4]  # the run stopped at the failed save
        assert sorted(p.name for p in root.iterdir()) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
        assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
        assert not _processes_naming(str(root)), "ranks left running"

        # Run again as it is (what torchrun's restart does): it stops before training, not at the same save.
        code, out = _train(command)
        assert code != 0 and not losses(out), out[-3000:]
        assert (f"not enough space to save the next checkpoint to {root}: the latest one (iter_0000002) holds "
                in out and "rerun the same command to resume from iteration 2" in out), out[-3000:]

        # A save that was killed leaves a staging directory; the next save removes it.
        (root / "iter_0000003.tmp" / "mp_rank_00_000").mkdir(parents=True)
        (root / "iter_0000003.tmp" / "mp_rank_00_000" / "model_optim_rng.pt.tmp").write_bytes(b"partial")
        remounted = subprocess.run(["mount", "-o", f"remount,size={one * 8 // 1024}k", str(mount)],
                                   capture_output=True, text=True)
        assert remounted.returncode == 0, remounted.stderr
        code, out = _train(command)  # the same command, with room now
        assert code == 0, out[-3000:]
        assert f"loaded checkpoint from {root} at iteration 2" in out
        assert f"removed {root / 'iter_0000003.tmp'}, left by an earlier save that did not finish" in out
        assert losses(out) == {k: expected[k] for k in range(3, 7)}
        assert sorted(p.name for p in root.iterdir()) == ["iter_0000002", "iter_0000004", "iter_0000006",
                                                          "latest_checkpointed_iteration.txt"]
        assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)
