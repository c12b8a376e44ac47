"""``strategy.generate`` through the pipeline against one process: the same tokens, greedy and sampled with a seed.

One launched job per world size runs several models (``generate_job.py``): each trains 3 steps in float64,
generates on every rank after step 2 from a callback (prompts of three lengths left-padded; greedy, greedy with
an EOS one row meets mid-way, sampled with temperature, top-k and a seed) and trains on; the reference is the
same module on one process with Hugging Face's ``generate`` (or, for the seed-convention GPT, the whole sequence
recomputed each step without a cache).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import generate_job
from conftest import run_script

from lightning_pp.errors import PipelineConfigError
from lightning_pp.generation.sampling import Chooser, Sampling

HERE = Path(__file__).parent
TWO = [
    {"model": "llama", "split": "trace", "name": "llama_1f1b", "predict": True},
    {"model": "llama", "split": "trace", "schedule": "zbv", "name": "llama_zbv"},  # 4 stages, a V on 2 ranks
    # float32: in float64 this traced MoE's first training step sends a message of another size (gloo refuses)
    {"model": "qwen3moe", "split": "trace", "name": "qwen3moe", "precision": "32-true"},
    {"model": "seed", "name": "seed", "predict": True, "samples": True},
    {"model": "nocache", "name": "nocache", "steps": 1, "at": 1, "val_batches": 0},
]
THREE = [{"model": "gpt2", "split": "trace", "schedule": "gpipe", "name": "gpt2_3"}]
FOUR = [{"model": "seed", "data_parallel": "fsdp", "pipeline_parallel_size": 2, "replicas": 2, "name": "seed_fsdp"}]
GENERATED = ("greedy", "greedy_eos", "sampled")


def generate_job_against_one_process(
    tmp_path_factory, ranks: int, cases: list[dict], accelerator: str = "cpu"
) -> tuple[Path, dict]:
    """``generate_job.py`` on ``ranks`` ranks, and in this process as one process (the reference)."""
    out = tmp_path_factory.mktemp(f"generate{ranks}")
    cfg = {"out": str(out), "ranks": ranks, "cases": cases, "accelerator": accelerator}
    code, output = run_script(HERE / "generate_job.py", 600, ranks=ranks, argv=[json.dumps(cfg)], cwd=out)
    assert code == 0, output[-4000:]
    reference = generate_job.run({**cfg, "out": str(out / "reference"), "pipelined": False, "threads": 2})
    return out, reference


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return generate_job_against_one_process(tmp_path_factory, 2, TWO)


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    return generate_job_against_one_process(tmp_path_factory, 3, THREE)


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return generate_job_against_one_process(tmp_path_factory, 4, FOUR)


def _ranks(out: Path, name: str, ranks: int) -> list[dict]:
    return [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(ranks)]


def same_as_one_process(out: Path, reference: dict, name: str, ranks: int, replicas: int = 1) -> None:
    one = reference[name]
    seen = _ranks(out, name, ranks)
    for r, got in enumerate(seen):
        prefix = f"{r // (ranks // replicas)}/" if r >= ranks // replicas else ""
        for kind in GENERATED:
            assert isinstance(one[prefix + kind], list), one[prefix + kind]
            assert got[prefix + kind] == one[prefix + kind], (name, r, kind)
        # training went on after generating as one process trains (replicas: on their batches together)
        assert got["loss"] == pytest.approx(one["loss"], abs=1e-6)
    rows = seen[0]["greedy_eos"]
    width = len(seen[0]["greedy"][0])
    assert len(rows[0]) < width or any(0 in row[6:] for row in rows), "some row meets its EOS mid-way"
    assert any(row[-1] != 0 for row in rows), "and some row goes on"


@pytest.mark.parametrize("name", ["llama_1f1b", "llama_zbv", "qwen3moe", "seed"])
def test_two_stages_generate_the_tokens_one_process_generates(two, name):
    out, reference = two
    same_as_one_process(out, reference, name, 2)


def test_three_stages_generate_the_tokens_one_process_generates(three):
    out, reference = three
    same_as_one_process(out, reference, "gpt2_3", 3)


def test_fsdp_replicas_each_generate_their_own_prompts_as_one_process(four):
    out, reference = four
    same_as_one_process(out, reference, "seed_fsdp", 4, replicas=2)


def test_each_stage_caches_its_own_layers_only(two):
    out, _ = two
    # a layer's keys and values: 5 rows x key/value heads x 11 positions x 8 per head, twice, in float64
    for name, stages, heads in (("seed", 2, 4), ("llama_zbv", 4, 2)):
        held = {s: b for rank in _ranks(out, name, 2) for s, b in rank["greedy_cache_bytes"].items()}
        assert len(held) == stages
        per_layer = 5 * heads * 11 * 8 * 2 * 8
        assert all(b == 4 // stages * per_layer for b in held.values()), held


def test_predict_and_samples_generate_as_one_process(two):
    out, reference = two
    for name in ("seed", "llama_1f1b"):  # pruned, and traced
        ranks = _ranks(out, name, 2)
        assert ranks[0]["predicted"] == reference[name]["predicted"]
        # a fresh Trainer and module (other weights): predict's first batch builds the stages from the step's
        # generation and reads the checkpoint's weights
        assert ranks[0]["predicted_from_checkpoint"] == reference[name]["predicted"]
        assert ranks[1]["predicted"] is None and ranks[1]["predicted_from_checkpoint"] is None
    lines = (out / "seed" / "version_0" / "samples.csv").read_text().splitlines()
    assert lines[0] == "step,prompt,sample"
    greedy = reference["seed"]["greedy"]
    assert [line.split(",")[2] for line in lines[1:]] == [" ".join(map(str, row[6:10])) for row in greedy[:2]]
    # TensorBoard: one text summary under "samples", the table's bytes as written in the event file
    events = b"".join(p.read_bytes() for p in (out / "tb" / "seed" / "version_0").glob("events.out.tfevents.*"))
    row = f"| {' '.join(map(str, greedy[0][:6]))} | {' '.join(map(str, greedy[0][6:10]))} |"
    assert b"samples/text_summary" in events and b"| prompt | sample |" in events and row.encode() in events


def test_layers_without_a_cache_are_refused_on_every_rank_and_training_goes_on(two):
    out, reference = two
    for rank in _ranks(out, "nocache", 2):
        assert rank["greedy"].startswith("PipelineConfigError: generate needs layers that keep a key/value cache")
        assert "NoCacheBlock" in rank["greedy"] and "past_key_values" in rank["greedy"]
        assert rank["loss"] == pytest.approx(reference["nocache"]["loss"], abs=1e-6)


def test_a_sample_draws_what_torch_multinomial_draws():
    probs = torch.softmax(torch.randn(6, 50, dtype=torch.float32) * 3, -1)
    chooser = Chooser(Sampling(do_sample=True, seed=11), 6, torch.device("cpu"))
    torch.manual_seed(11)
    expected = torch.multinomial(probs, 1)[:, 0]
    lanes = [chooser.choose(probs.log()[rows], rows, 0) for rows in (slice(0, 4), slice(4, 6))]
    assert torch.cat(lanes).tolist() == expected.tolist()


@pytest.mark.parametrize(
    "arguments, named",
    [
        ({"max_new_tokens": 0}, "max_new_tokens=0"),
        ({"temperature": 0.0}, "temperature=0.0"),
        ({"top_k": 0}, "top_k=0"),
        ({"top_p": 1.5}, "top_p=1.5"),
        ({"microbatches": 0}, "microbatches=0"),
    ],
)
def test_bad_sampling_arguments_name_the_value(arguments, named):
    with pytest.raises(PipelineConfigError, match=named.replace(".", r"\.")):
        Sampling(**arguments)
