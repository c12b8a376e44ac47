"""Checkpoints one can trust: opening one runs no code it carries, and a damaged one is refused by name.

Checkpoints are the project's own (a 2-rank job's sharded saves, one process's full ``.ckpt``), then altered as
they would be on the way: an object planted whose unpickling creates a marker directory, a shard cut short, a byte
flipped, a shard from another save, ``.metadata`` lost.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from conftest import consolidate_cli, ok, run_job

from lightning_pp import DamagedCheckpointError, UntrustedCheckpointError
from lightning_pp.checkpoints.export import export_hf, export_peft
from lightning_pp.checkpoints.integrity import RECORD_FILE, file_record
from lightning_pp.checkpoints.restore import open_checkpoint
from lightning_pp.consolidate import consolidate

BASE = dict(batch=8, n_train=32, sanity=0, n_val=8, max_epochs=1, devices=2, m=2, strategy="pipeline")


class Planted:
    """Unpickling it creates a directory: the proof that a door ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


class Opaque:
    """An object of the user's own, harmless: loads where the user trusts the checkpoint."""

    def __init__(self, value: int) -> None:
        self.value = value


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A 2-rank job's sharded checkpoints (async saves at steps 2 and 4) and its synchronous final one."""
    out = tmp_path_factory.mktemp("trust") / "job"
    ok(run_job({**BASE, "max_steps": 4, "save_every": 2, "state_dict_type": "sharded", "async_save": True}, out))
    return out


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst) if src.is_dir() else shutil.copy(src, dst)
    return dst


def rerecord(ckpt: Path) -> None:
    """The records rewritten to match the files, as someone altering a checkpoint on purpose would."""
    record = json.loads((ckpt / RECORD_FILE).read_text())
    record["files"] = {name: file_record(ckpt / name) for name in record["files"]}
    (ckpt / RECORD_FILE).write_text(json.dumps(record))


def plant(ckpt: Path, door: str, obj: object) -> None:
    if door == "meta.pt":
        meta = torch.load(ckpt / "meta.pt", weights_only=True)
        torch.save({**meta, "hyper_parameters": {"lr": obj}}, ckpt / "meta.pt")
    elif door == ".metadata":
        with open(ckpt / ".metadata", "rb") as stream:
            metadata = pickle.load(stream)
        metadata.storage_meta = obj
        with open(ckpt / ".metadata", "wb") as stream:
            pickle.dump(metadata, stream)
    else:  # a .ckpt file
        whole = torch.load(ckpt, weights_only=True)
        torch.save({**whole, "hyper_parameters": {"lr": obj}}, ckpt)
    if ckpt.is_dir():
        rerecord(ckpt)


def test_the_records_are_each_file_as_written_and_the_checkpoints_open_with_defaults(saved, tmp_path):
    ckpts = [saved / "ckpts" / "step=2.ckpt", saved / "ckpts" / "step=4.ckpt", saved / "final.ckpt"]
    for ckpt in ckpts:  # async (taken in the writer's thread behind the write) and synchronous saves
        files = json.loads((ckpt / RECORD_FILE).read_text())["files"]
        assert sorted(files) == sorted(p.name for p in ckpt.iterdir() if p.name != RECORD_FILE)
        assert {name: file_record(ckpt / name) for name in files} == files
        checkpoint, pending = open_checkpoint(ckpt)
        assert pending.sharded and checkpoint["global_step"] in (2, 4)
    whole = torch.load(consolidate(saved / "final.ckpt", tmp_path / "final.ckpt"), weights_only=True)
    assert whole["global_step"] == 4 and whole["state_dict"]


@pytest.mark.parametrize("door", ["meta.pt", ".metadata", "shard", "full"])
def test_no_planted_object_runs_through_open_consolidate_or_export(saved, tmp_path, reference, door):
    marker = tmp_path / "marker"
    if door == "full":
        ckpt = copy(reference(batch=8, n_train=32, n_val=8, sanity=0, max_steps=2)["out"] / "final.ckpt",
                    tmp_path / "full.ckpt")  # fmt: skip
        plant(ckpt, door, Planted(marker))
    elif door == "shard":  # a non-tensor value of a shard (DCP reads those with weights_only=False)
        ckpt = tmp_path / "shard.ckpt"
        from lightning_pp.checkpoints.formats import save_sharded

        save_sharded({"state_dict": {"w": torch.ones(2), "x": Planted(marker)}, "optimizer_states": []}, ckpt, 0, None)
    else:
        ckpt = copy(saved / "final.ckpt", tmp_path / "final.ckpt")
        plant(ckpt, door, Planted(marker))
    opens = [lambda: open_checkpoint(ckpt), lambda: export_hf(ckpt, tmp_path / "hf"),
             lambda: export_peft(ckpt, tmp_path / "peft")] if door != "shard" else []  # those read no such value
    if ckpt.is_dir():
        opens.append(lambda: consolidate(ckpt, tmp_path / "whole.ckpt"))
    for attempt in opens:
        with pytest.raises(UntrustedCheckpointError) as refused:
            attempt()
        if door == "shard":  # read with the tensors: refused as the value is read
            assert "'model.x'" in str(refused.value) and "os.makedirs" in str(refused.value), refused.value
        else:
            where = ckpt if door == "full" else ckpt / door
            assert str(where) in str(refused.value) and "os.makedirs" in str(refused.value), refused.value
            assert "weights_only=False" in str(refused.value)
    assert not marker.exists()
    if door in ("meta.pt", "full"):  # the command line says the same, and runs nothing
        proc = consolidate_cli(ckpt, tmp_path / "hf", "--format", "hf")
        assert proc.returncode != 0 and "os.makedirs" in proc.stderr and not marker.exists(), proc.stderr[-2000:]


def test_a_trusted_checkpoint_with_the_users_own_objects_opens_with_weights_only_false(saved, tmp_path):
    ckpt = copy(saved / "final.ckpt", tmp_path / "final.ckpt")
    plant(ckpt, "meta.pt", Opaque(3))
    with pytest.raises(UntrustedCheckpointError, match="test_trust.Opaque"):
        open_checkpoint(ckpt)
    checkpoint, _ = open_checkpoint(ckpt, weights_only=False)
    assert checkpoint["hyper_parameters"]["lr"].value == 3
    proc = consolidate_cli(ckpt, tmp_path / "whole.ckpt", "--trust")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert torch.load(tmp_path / "whole.ckpt", weights_only=False)["hyper_parameters"]["lr"].value == 3


def damage(ckpt: Path, kind: str, other: Path) -> Path:
    """The damaged file."""
    shard = ckpt / "__0_0.distcp"  # rank 0's shard; at a 2-rank resume rank 1 checksums it (file i on rank i mod 2)
    if kind == "truncated":
        os.truncate(shard, shard.stat().st_size // 2)
    elif kind == "flipped":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x10
        shard.write_bytes(bytes(data))
    elif kind == "other save":
        shutil.copy(other / shard.name, shard)
    elif kind == "no .metadata":
        (ckpt / ".metadata").unlink()
        return ckpt / ".metadata"
    return shard


@pytest.mark.parametrize("kind", ["truncated", "flipped", "other save", "no .metadata"])
def test_a_damaged_checkpoint_is_refused_naming_the_file_and_the_newest_good_one(saved, tmp_path, kind):
    ckpts = copy(saved / "ckpts", tmp_path / "ckpts")
    bad = damage(ckpts / "step=4.ckpt", kind, ckpts / "step=2.ckpt")
    for attempt in (lambda: open_checkpoint(ckpts / "step=4.ckpt"), lambda: consolidate(bad.parent, tmp_path / "x")):
        with pytest.raises(DamagedCheckpointError) as refused:
            attempt()
        message = str(refused.value)
        assert str(bad) in message and "nothing was loaded" in message, message
        found = {"truncated": "bytes, expected", "flipped": "the save recorded", "other save": "the save recorded",
                 "no .metadata": "missing (expected"}[kind]  # fmt: skip
        assert found in message, message
        assert f"The newest earlier checkpoint beside it that checks: {ckpts / 'step=2.ckpt'}" in message
    assert not (tmp_path / "x").exists()


def test_a_full_checkpoint_cut_short_or_changed_is_refused(tmp_path, reference):
    source = reference(batch=8, n_train=32, n_val=8, sanity=0, max_steps=2)["out"] / "final.ckpt"
    for kind in ("flipped", "truncated"):
        ckpt = copy(source, tmp_path / f"{kind}.ckpt")
        data = bytearray(ckpt.read_bytes())
        if kind == "flipped":  # inside a tensor's bytes: torch reads it back without a word
            data[data.index(b"data/0") + 200] ^= 0x01
        ckpt.write_bytes(bytes(data[: len(data) - 64] if kind == "truncated" else data))
        with pytest.raises(DamagedCheckpointError, match=str(ckpt).replace("+", r"\+")):
            open_checkpoint(ckpt)


def test_a_checkpoint_without_records_still_opens_and_says_so_once(saved, tmp_path):
    from lightning_pp.checkpoints.formats import save_sharded

    unrecorded = tmp_path / "unrecorded.ckpt"  # PipelineStrategy(checksums=False)
    save_sharded({"state_dict": {"w": torch.ones(3)}, "optimizer_states": []}, unrecorded, 0, None, checksums=False)
    assert not (unrecorded / RECORD_FILE).exists() and (unrecorded / "meta.pt").exists()
    ckpt = copy(saved / "final.ckpt", tmp_path / "final.ckpt")
    (ckpt / RECORD_FILE).unlink()  # as written before the records
    with pytest.warns(UserWarning, match="without checksums") as said:
        checkpoint, _ = open_checkpoint(ckpt)
    assert len([w for w in said if "checksums" in str(w.message)]) == 1 and checkpoint["global_step"] == 4
    os.truncate(ckpt / "__0_0.distcp", 100)  # sizes are still checked, from .metadata
    with pytest.raises(DamagedCheckpointError, match="__0_0.distcp: 100 bytes, expected at least"):
        open_checkpoint(ckpt)


def test_every_rank_refuses_at_resume_and_validate_with_nothing_run(saved, tmp_path, reference):
    # one job per door, 2 ranks each: a planted meta.pt at resume, a planted .metadata at validate, a planted full
    # .ckpt at resume, a flipped byte in a shard at resume (only rank 1 checksums it: rank 0 learns it through the
    # store)
    marker = tmp_path / "marker"
    full = copy(reference(batch=8, n_train=32, n_val=8, sanity=0, max_steps=2)["out"] / "final.ckpt",
                tmp_path / "full.ckpt")  # fmt: skip
    plant(full, "full", Planted(marker))
    planted = copy(saved / "final.ckpt", tmp_path / "planted.ckpt")
    plant(planted, "meta.pt", Planted(marker))
    metadata = copy(saved / "final.ckpt", tmp_path / "metadata.ckpt")
    plant(metadata, ".metadata", Planted(marker))
    ckpts = copy(saved / "ckpts", tmp_path / "ckpts")
    bad = damage(ckpts / "step=4.ckpt", "flipped", ckpts / "step=2.ckpt")
    cases = [({"resume": str(planted)}, "UntrustedCheckpointError", str(planted / "meta.pt")),
             ({"validate_from": str(metadata)}, "UntrustedCheckpointError", str(metadata / ".metadata")),
             ({"resume": str(full)}, "UntrustedCheckpointError", str(full)),
             ({"resume": str(ckpts / "step=4.ckpt")}, "DamagedCheckpointError", str(bad))]  # fmt: skip
    for i, (cfg, error, named) in enumerate(cases):
        job = run_job({**BASE, "max_steps": 6, "state_dict_type": "sharded", "timeout": 30, **cfg}, tmp_path / f"j{i}",
                      timeout=120)  # fmt: skip
        assert all(code != 0 for code in job.codes) and job.seconds < 60, job.output[-3000:]
        # each rank raised it (its traceback printed), naming the file
        assert job.output.count(f"{error}: ") == 2 and job.output.count(named) >= 2, job.output[-4000:]
        assert not (tmp_path / f"j{i}" / "rank0.json").exists()
    assert not marker.exists()
