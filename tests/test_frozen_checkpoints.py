"""Checkpoints without the frozen base (``lightning_pp/checkpoints/frozen.py``): a LoRA fine-tune's checkpoints hold
the adapters and their optimizer state, resume by reading the base from ``init_weights`` again, and are refused when
that base is not there as it was."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import ok, run_job
from models import HFLlama, LoraLlama
from test_adapter_export import assert_exports_reproduce
from test_checkpoints import after
from test_tied import assert_state_equal

from lightning_pp.checkpoints.adapters import adapter_sites
from lightning_pp.checkpoints.formats import load_sharded
from lightning_pp.checkpoints.frozen import FROZEN_KEY, read_base
from lightning_pp.checkpoints.pretrained import match_weights, open_pretrained
from lightning_pp.checkpoints.restore import PendingRestore, check_state_keys, open_checkpoint
from lightning_pp.errors import PipelineConfigError

LOSS_TOL, PARAM_TOL = 2e-4, 1e-5
LORA = dict(model="lora_llama", split="trace", layers="model.base_model.model.model.layers",
            optimizer="adamw", lr=1e-2, batch=8, n_train=32, n_val=8, limit_val_batches=0, sanity=0, max_epochs=10,
            devices=2, strategy="pipeline")  # fmt: skip


def _base(root: Path) -> Path:
    """An HF Llama directory (several safetensors shards and their index), from weights no run starts from."""
    torch.manual_seed(123)
    HFLlama().model.save_pretrained(root / "llama", max_shard_size="40KB")
    return root / "llama"


def _base_tensors(base: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(base.glob("*.safetensors")) for k, v in load_file(f).items()}


def _with_base(checkpoint: dict, base: Path, out: Path) -> Path:
    """The checkpoint one process can resume from: the left-out base put back under the module's names."""
    tensors = _base_tensors(base)
    record = checkpoint.pop(FROZEN_KEY)
    site = adapter_sites(LoraLlama())[0]
    checkpoint["state_dict"].update({n: tensors[site.base_key(n)] for n in record["left_out"]})
    torch.save(checkpoint, out)
    return out


def _adapters(names) -> set[str]:
    return {n for n in names if ".lora_" in n}


def test_lora_checkpoints_leave_the_base_out_resume_from_it_and_are_refused_when_it_changed(tmp_path, reference):
    base = _base(tmp_path)
    lora = dict(LORA, init_weights=str(base))
    # 2 stages under 1F1B, a full checkpoint at step 4 (the end of the first epoch)
    first = ok(run_job(dict(lora, schedule="1f1b", m=2, max_steps=4), tmp_path / "first", timeout=240))
    small = torch.load(first.out / "final.ckpt", weights_only=False)
    names = set(LoraLlama().state_dict())
    assert set(small["state_dict"]) == _adapters(names) and len(_adapters(names)) == 8
    assert len(small["optimizer_states"][0]["state"]) == 8  # AdamW's moments of the adapters only
    record = small[FROZEN_KEY]
    assert set(record["left_out"]) == names - _adapters(names) and record["init_weights"] == str(base.resolve())
    assert set(record["fingerprint"]) == {p.name for p in base.glob("*.safetensors")} | {"model.safetensors.index.json"}

    # resumed under interleaved 1F1B (4 stages on 2 ranks), the base read from init_weights again; sharded saves
    # in the background every 2 steps
    second = ok(run_job(dict(lora, schedule="interleaved_1f1b", m=4, max_steps=8, state_dict_type="sharded",
                             save_every=2, async_save=True, resume=str(first.out / "final.ckpt")),
                        tmp_path / "second", timeout=240))  # fmt: skip
    one = reference(**dict(LORA, max_steps=8, resume=str(_with_base(small, base, tmp_path / "step4.ckpt"))))
    got, expected = after(second.rank(0)["logged"], 4), after(one["logged"], 4)
    assert len(got) == len(expected) == 4 and got == pytest.approx(expected, abs=LOSS_TOL)
    step8 = second.out / "ckpts" / "step=8.ckpt"  # written in the background
    sharded = load_sharded(step8)
    assert set(sharded["state_dict"]) == _adapters(names) and len(sharded["optimizer_states"][0]["state"]) == 8
    assert_state_equal(sharded["state_dict"], {n: one["state"][n] for n in _adapters(names)}, PARAM_TOL)

    # resumed from the sharded directory under 1F1B with save_frozen=True: the whole model, base unchanged
    third = ok(run_job(dict(lora, schedule="1f1b", m=2, max_steps=10, save_frozen=True,
                            resume=str(step8)), tmp_path / "third", timeout=240))  # fmt: skip
    one = reference(**dict(LORA, max_steps=10, resume=str(_with_base(sharded, base, tmp_path / "step8.ckpt"))))
    # step 8's directory (sharded, without its base) exported both ways, the base read from the recorded init_weights
    whole = torch.load(tmp_path / "step8.ckpt", weights_only=False)["state_dict"]
    assert_exports_reproduce(step8, whole, initial=whole)  # the base is the same at every step: frozen
    got, expected = after(third.rank(0)["logged"], 8), after(one["logged"], 8)
    assert len(got) == len(expected) == 2 and got == pytest.approx(expected, abs=LOSS_TOL)
    full = torch.load(third.out / "final.ckpt", weights_only=False)
    assert FROZEN_KEY not in full and set(full["state_dict"]) == names
    assert_state_equal(full["state_dict"], one["state"], PARAM_TOL)
    tensors = _base_tensors(base)
    site = adapter_sites(LoraLlama())[0]
    assert all(torch.equal(full["state_dict"][n], tensors[site.base_key(n)]) for n in record["left_out"])
    sizes = {"without the base": os.path.getsize(first.out / "final.ckpt"),
             "save_frozen=True": os.path.getsize(third.out / "final.ckpt")}  # fmt: skip
    print(f"checkpoint bytes: {sizes}")
    assert sizes["without the base"] < 0.25 * sizes["save_frozen=True"], sizes

    # the base is needed, as it was: refused on every rank at load, naming the path and what changed
    ckpt = first.out / "final.ckpt"
    with pytest.raises(PipelineConfigError, match=rf"{ckpt} leaves out 39 frozen tensors .* gives no init_weights"):
        open_checkpoint(ckpt)
    copy = shutil.copytree(base, tmp_path / "copy")
    with pytest.raises(PipelineConfigError, match=r"but this run gives init_weights='.*copy'.*save_frozen=True"):
        open_checkpoint(ckpt, init_weights=copy)
    shard = sorted(base.glob("*.safetensors"))[1]
    from safetensors.torch import load_file, save_file

    save_file({k: v + 1 for k, v in load_file(shard).items()}, shard, metadata={"format": "pt"})  # same size
    with pytest.raises(PipelineConfigError, match=rf"files changed since: {shard.name} (was rewritten at|has)"):
        open_checkpoint(ckpt, init_weights=base)
    shard.unlink()
    with pytest.raises(PipelineConfigError, match=rf"{shard.name} is gone"):
        open_checkpoint(ckpt, init_weights=base)
    shutil.rmtree(base)
    with pytest.raises(PipelineConfigError, match=r"nothing exists at that path any more"):
        open_checkpoint(ckpt, init_weights=str(base))
    shutil.copytree(copy, base)  # put back as it was (copied with its modification times): accepted
    assert open_checkpoint(ckpt, init_weights=base)[1].left_out == set(record["left_out"])


def test_only_what_init_weights_set_and_training_never_touched_is_left_out(tmp_path):
    base = _base(tmp_path)
    model = LoraLlama()
    pretrained = open_pretrained(base)
    weights = match_weights(pretrained, model)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == set(weights.keys)  # the base: every frozen parameter, no adapter
    norm = "model.base_model.model.model.norm.weight"
    weights = type(weights)({n: k for n, k in weights.keys.items() if n != norm}, weights.left, weights.prefix)
    found = read_base(base, model, weights)
    assert found.names == frozen - {norm}  # frozen, but its module initialised it: kept
    optimizer = torch.optim.AdamW(model.parameters())
    head, q = "model.base_model.model.lm_head.weight", "model.base_model.model.model.layers.0.self_attn.q_proj.weight"
    model.get_parameter(head).requires_grad_(True)  # unfrozen (a later save keeps it even if frozen again)
    optimizer.state[model.get_parameter(q)] = {"step": torch.tensor(1.0)}  # it trained at some point
    assert found.still_frozen(model, [optimizer]) == frozen - {norm, head, q}
    model.get_parameter(head).requires_grad_(False)
    assert found.still_frozen(model, []) == frozen - {norm, head, q}

    # a checkpoint that records keys as left out may lack them; any other missing key is refused
    expected = model.state_dict()
    found_keys = {k: v for k, v in expected.items() if k not in frozen}
    check_state_keys(expected, found_keys, True, PendingRestore(tmp_path, False, left_out=frozenset(frozen)))
    with pytest.raises(PipelineConfigError, match=r"missing keys \[.*norm\.weight'\]"):
        check_state_keys(
            expected, found_keys, True, PendingRestore(tmp_path, False, left_out=frozenset(frozen - {norm}))
        )
