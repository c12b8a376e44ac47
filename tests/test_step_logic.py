"""The pure pieces of a pipelined step: splitting, capture, log combination, schedule checks."""

import dataclasses

import pytest
import torch
from torch import nn

from lightning_pp.errors import PipelineConfigError
from lightning_pp.layout.schedule import (
    SCHEDULES,
    check_batch_size,
    check_microbatches,
    default_microbatches,
    normalize_schedule,
    rank_of_stage,
    resolve_stages_per_rank,
    schedule_for,
    stages_of_rank,
)
from lightning_pp.runtime.relay import LogRecord, LogRecorder, combine
from lightning_pp.split.microbatch import (
    batch_size_of,
    capture_model_call,
    known_containers,
    merge_microbatches,
    signature,
    split_batch,
)
from lightning_pp.split.planning import batch_statistics_note


def test_split_dict_batch_replicates_non_tensor_leaves():
    batch = {"x": torch.arange(8).view(8, 1), "meta": "train", "n": torch.tensor(3), "pair": (torch.ones(8, 2), 5)}
    parts = split_batch(batch, 4)
    assert len(parts) == 4
    assert parts[1]["x"].flatten().tolist() == [2, 3]
    assert parts[3]["meta"] == "train" and parts[3]["n"].item() == 3 and parts[3]["pair"][1] == 5
    assert parts[0]["pair"][0].shape == (2, 2)


def test_split_cuts_lists_of_one_item_per_sample_with_the_tensors():
    # default_collate lists strings per sample: whole, each micro-batch would pair the batch's first texts with its
    # own rows (a text metric in validation, per-sample ids); a list of another length goes to every micro-batch
    batch = {"x": torch.arange(8), "text": [f"t{i}" for i in range(8)], "classes": ["a", "b"], "ids": list(range(8))}
    parts = split_batch(batch, 4)
    assert [p["text"] for p in parts] == [["t0", "t1"], ["t2", "t3"], ["t4", "t5"], ["t6", "t7"]]
    assert parts[2]["ids"] == [4, 5] and parts[2]["x"].tolist() == [4, 5] and parts[3]["classes"] == ["a", "b"]


def test_predictions_joined_over_micro_batches_are_what_one_call_on_the_batch_returns():
    # a predict step handing back its ids and texts beside the logits: joined per sample, not per position
    batch = {"x": torch.arange(8), "text": [f"t{i}" for i in range(8)], "ids": list(range(8))}
    outputs = [{"y": mb["x"] * 2, "text": mb["text"], "ids": mb["ids"], "split": "val"} for mb in split_batch(batch, 4)]
    merged = merge_microbatches(outputs, 2)
    assert merged["text"] == batch["text"] and merged["ids"] == batch["ids"] and merged["split"] == "val"
    assert merged["y"].tolist() == (batch["x"] * 2).tolist()
    # what differs per micro-batch and is not one item per sample stays one entry per micro-batch
    assert merge_microbatches([(torch.zeros(2), i) for i in range(4)], 2)[1] == [0, 1, 2, 3]


def test_batch_norm_layers_are_told_of_the_samples_they_normalise():
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Sequential(nn.BatchNorm1d(2)))
    said = batch_statistics_note(net, 8, 1)
    assert said.startswith("2 BatchNorm layer(s) (1, 2.0) normalise each micro-batch by its own statistics (this")
    assert "8 of 1 sample(s)" in said
    assert batch_statistics_note(net, 1, 8) is None and batch_statistics_note(nn.Linear(2, 2), 8, 1) is None


def test_split_rejects_leaves_of_another_length_naming_them():
    with pytest.raises(PipelineConfigError, match=r"\['w'\] has 3 rows but the batch has 8"):
        split_batch({"x": torch.zeros(8), "w": torch.zeros(3)}, 2)


@pytest.mark.parametrize("size,m", [(10, 4), (2, 4)])
def test_batches_that_do_not_split_name_the_fix(size, m):
    with pytest.raises(PipelineConfigError, match=rf"{size} samples.*n_microbatches={m}.*drop_last=True"):
        split_batch(torch.zeros(size, 3), m)


def test_default_microbatches_is_the_largest_divisor_within_bounds():
    assert default_microbatches(32, "1f1b", 2, 2) == 8
    assert default_microbatches(24, "gpipe", 4, 4) == 12
    assert default_microbatches(7, "1f1b", 2, 2) == 7
    # interleaved 1F1B runs rounds of pp micro-batches: 9 would need 9 % 4 rounds == 0, so 8 it is
    assert default_microbatches(72, "interleaved_1f1b", 2, 4) == 12
    assert default_microbatches(18, "interleaved_1f1b", 2, 4) == 6
    # a batch with no divisor in [stages, 4 x stages] (a last, partial one; a prime size): the nearest above, else
    # the largest below, which 1F1B and DualPipeV run in GPipe's and ZBV's order
    assert default_microbatches(11, "1f1b", 2, 2) == 11 and default_microbatches(1, "1f1b", 2, 2) == 1
    assert default_microbatches(3, "dualpipev", 2, 4) == 3 and schedule_for("dualpipev", 3, 4) == "zbv"
    assert schedule_for("1f1b", 1, 2) == "gpipe" and schedule_for("1f1b", 2, 2) == "1f1b"
    assert schedule_for("interleaved_1f1b", 1, 4) == "interleaved_1f1b"
    with pytest.raises(PipelineConfigError, match="schedule='2bw' accepts no divisor of 1"):
        default_microbatches(1, "2bw", 2, 2)  # PipeDream-2BW's stream keeps 1F1B's order


def test_schedule_names():
    assert normalize_schedule("GPipe") == "gpipe" and normalize_schedule("Schedule1F1B") == "1f1b"
    assert SCHEDULES[normalize_schedule("1F1B")].__name__ == "Schedule1F1B"
    # torch's class names and its get_schedule_class registry names are accepted too
    assert normalize_schedule("ZBVZeroBubble") == "zbv" and normalize_schedule("ScheduleDualPipeV") == "dualpipev"
    assert normalize_schedule("Interleaved1F1B") == normalize_schedule("interleaved-1f1b") == "interleaved_1f1b"
    assert normalize_schedule("InterleavedZeroBubble") == "interleaved_zb"
    assert normalize_schedule("LoopedBFS") == "looped_bfs"
    with pytest.raises(
        PipelineConfigError, match=r"Unknown schedule='pipedream'; valid schedules are \['gpipe', '1f1b'"
    ):
        normalize_schedule("pipedream")


def test_stage_placement_loop_and_v():
    # loop: stage s on rank s % pp; V: (r, 2p-1-r), so the last stage is on pipeline rank 0
    assert [stages_of_rank("interleaved_1f1b", r, 4, 2) for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [stages_of_rank("zbv", r, 4, 2) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [rank_of_stage("dualpipev", s, 2) for s in range(4)] == [0, 1, 1, 0]
    assert [rank_of_stage("looped_bfs", s, 2) for s in range(6)] == [0, 1, 0, 1, 0, 1]
    assert resolve_stages_per_rank("1f1b", None) == 1 and resolve_stages_per_rank("interleaved_zb", None) == 2
    assert resolve_stages_per_rank("looped_bfs", 3) == 3
    with pytest.raises(PipelineConfigError, match=r"exactly two stages per rank.*stages_per_rank=3"):
        resolve_stages_per_rank("zbv", 3)
    with pytest.raises(PipelineConfigError, match=r"one stage per rank, but stages_per_rank=2"):
        resolve_stages_per_rank("gpipe", 2)


def test_1f1b_needs_as_many_microbatches_as_stages():
    check_microbatches("gpipe", 2, 4, 4)
    with pytest.raises(PipelineConfigError, match=r"n_microbatches=2 and there are 4 stages; use n_microbatches=4"):
        check_microbatches("1f1b", 2, 4, 4)
    with pytest.raises(PipelineConfigError, match="must be a positive integer"):
        check_microbatches("gpipe", 0, 2, 2)
    with pytest.raises(PipelineConfigError, match=r"n_microbatches=3 and there are 4 stages"):
        check_microbatches("dualpipev", 3, 2, 4)
    with pytest.raises(PipelineConfigError, match=r"n_microbatches=5 must be a multiple of its 2 rounds"):
        check_microbatches("interleaved_1f1b", 5, 2, 4)
    with pytest.raises(PipelineConfigError, match="The last batch has 8 samples"):
        check_batch_size(8, 3, "The last batch")


def test_capture_stops_at_the_model_call_and_discards_earlier_logs():
    class M(nn.Module):
        def forward(self, x, scale=1.0):
            raise AssertionError("the real forward must not run")

        def log(self, *args, **kwargs):
            raise AssertionError("logging is discarded while capturing")

        def step(self, batch, idx):
            self.log("before", 1.0)
            return self(batch["x"] * 2, scale=0.5).sum()

    module = M()
    call = capture_model_call(module, {"": module}, module.step, ({"x": torch.ones(2)}, 0), {}, "step")
    assert call.entry == "" and torch.equal(call.args[0], torch.full((2,), 2.0)) and call.kwargs == {"scale": 0.5}

    class Wrapper(M):
        def __init__(self):
            super().__init__()
            self.model = M()

        def step(self, batch, idx):
            return self.model(batch["x"]).sum()

    wrapper = Wrapper()
    entries = {"": wrapper, "model": wrapper.model}
    call = capture_model_call(wrapper, entries, wrapper.step, ({"x": torch.ones(2)}, 0), {}, "step")
    assert call.entry == "model"

    class Never(M):
        def step(self, batch, idx):
            return torch.zeros(())

    never = Never()
    with pytest.raises(PipelineConfigError, match=r"did not call the model \(self\(\.\.\.\)\) for") as error:
        capture_model_call(never, {"": never}, never.step, ({}, 0), {}, "training_step")
    assert "returned None" not in str(error.value)

    class Skips(M):  # Lightning skips a batch whose step returns None; the pipeline's stages cannot
        def step(self, batch, idx):
            return None if idx == 1 else self(batch["x"]).sum()

    skips = Skips()
    assert capture_model_call(skips, {"": skips}, skips.step, ({"x": torch.ones(2)}, 0), {}, "step").entry == ""
    with pytest.raises(PipelineConfigError, match="It returned None, which skips the batch.*in the DataLoader"):
        capture_model_call(skips, {"": skips}, skips.step, ({"x": torch.ones(2)}, 1), {}, "training_step")


def test_logs_combine_over_microbatches_by_reduce_fx():
    recorder = LogRecorder()
    for value in (1.0, 3.0):
        recorder.weight = 2.0
        recorder("loss", torch.tensor(value), prog_bar=True)
        recorder("n", value, reduce_fx="sum")
        recorder("hi", torch.tensor(value), reduce_fx=torch.max)
        recorder("lo", torch.tensor(value), reduce_fx="min")
    out = {r.name: r for r in combine(recorder.records)}
    assert out["loss"].value.item() == 2.0 and out["loss"].options["prog_bar"] is True
    assert out["n"].value.item() == 4.0 and out["hi"].value.item() == 3.0 and out["lo"].value.item() == 1.0


def test_explicit_batch_sizes_weight_the_mean_and_add_up():
    records = [
        LogRecord("acc", torch.tensor(1.0), {"reduce_fx": "mean", "batch_size": 3}, 3.0),
        LogRecord("acc", torch.tensor(0.0), {"reduce_fx": "mean", "batch_size": 1}, 1.0),
    ]
    (out,) = combine(records)
    assert out.value.item() == pytest.approx(0.75) and out.options["batch_size"] == 4


def test_unsupported_log_values_and_reductions_are_named():
    recorder = LogRecorder()
    with pytest.raises(ValueError, match=r"reduce_fx=<built-in function len>"):
        recorder("x", 1.0, reduce_fx=len)
    with pytest.raises(TypeError, match=r"self.log\('x', str\)"):
        recorder("x", "text")


def test_activations_replace_the_leading_inputs_positional_or_keyword():
    from lightning_pp.split.pruned import replace_leading_inputs

    class Net(nn.Module):
        def forward(self, input_ids, mask=None, scale=1.0):
            return input_ids

    net, h = Net(), torch.ones(2, 3)
    args, kwargs = replace_leading_inputs(Net.forward, net, (), {"input_ids": torch.zeros(2), "mask": 5}, (h,))
    assert args[0] is h and args[1] == 5 and kwargs == {}
    args, kwargs = replace_leading_inputs(Net.forward, net, (torch.zeros(2), 7), {"scale": 0.5}, (h,))
    assert args[0] is h and args[1:] == (7, 0.5) and kwargs == {}
    assert Net.forward(net, *args, **kwargs) is h


def test_the_strategys_arguments_are_normalised_once_in_its_order() -> None:
    """``PipelineOptions`` takes the strategy's arguments positionally: the same names in the same order."""
    import dataclasses
    import inspect
    from datetime import timedelta

    from lightning_pp import PipelineStrategy
    from lightning_pp.layout.options import PipelineOptions

    arguments = list(inspect.signature(PipelineStrategy.__init__).parameters)[1:-1]
    chosen = ("auto", "planned", "forecast")  # what the first batch chose for "auto" arguments: state, not arguments
    assert arguments == [f.name for f in dataclasses.fields(PipelineOptions) if f.name not in chosen]
    options = PipelineStrategy(schedule="ZBVZeroBubble", n_microbatches="8", timeout=5).options
    assert (options.schedule, options.n_microbatches, options.stages_per_rank) == ("zbv", 8, 2)
    assert options.timeout == timedelta(seconds=5) and options.split_backward and not options.asynchronous
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.schedule = "gpipe"  # type: ignore[misc]
    with pytest.raises(PipelineConfigError, match=r"schedule='2bw' with split='trace' is not supported yet"):
        PipelineOptions(schedule="2bw", split="trace")


def _relay_rank(rank: int, port: int, out: str) -> None:
    import os
    import pickle

    import torch.distributed as dist

    from lightning_pp.runtime.relay import ReportRelay, StepReport

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    relay = ReportRelay(1, [0, 1], None, torch.device("cpu"))
    got = []
    for n_logs in (1, 400, 2):  # a step's few logs, then a report past the first message's 16 KiB, then few again
        logs = [LogRecord(f"metric_{i}", torch.tensor(float(i)), {"reduce_fx": "mean"}, 1.0) for i in range(n_logs)]
        report = relay.relay(StepReport(torch.tensor(0.5 * n_logs), logs) if rank == 1 else None)
        got.append((float(report.loss), [(r.name, float(r.value)) for r in report.logs], len(pickle.dumps(report))))
    relay.flush()
    dist.destroy_process_group()
    with open(f"{out}/{rank}.pkl", "wb") as f:
        pickle.dump(got, f)


def test_the_report_relay_carries_small_and_large_reports_in_order(tmp_path):
    import pickle

    import torch.multiprocessing as mp
    from conftest import free_port

    mp.start_processes(_relay_rank, args=(free_port(), str(tmp_path)), nprocs=2, start_method="fork")
    sent, received = (pickle.loads((tmp_path / f"{r}.pkl").read_bytes()) for r in (1, 0))
    assert received == sent and [len(logs) for _, logs, _ in received] == [1, 400, 2]
    assert received[1][2] > 16384  # the large one took the second message


def _relay_meanings_rank(rank: int, port: int, out: str, apart: bool) -> None:
    import os
    import pickle

    import torch.distributed as dist

    from lightning_pp.runtime import relay as relay_module
    from lightning_pp.runtime.relay import ReportRelay, StepReport

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    # apart: the values over the pipeline's group and the rest over a host group, as under NCCL (both gloo here)
    host = dist.new_group([0, 1], backend="gloo") if apart else None
    relay = ReportRelay(1, [0, 1], None, torch.device("cpu"), host)
    told = []
    loads = relay_module.pickle.loads
    relay_module.pickle.loads = lambda data: told.append(1) or loads(data)
    mean, total = {"reduce_fx": "mean", "batch_size": None}, {"reduce_fx": "sum", "batch_size": 4}
    steps = [  # (loss, logs): the same meaning twice, a new name, a dtype, batch_size options, no loss, nothing
        (torch.tensor(0.25), [("a", torch.tensor(1.5), mean)]),
        (torch.tensor(0.5), [("a", torch.tensor(2.5), mean)]),
        (torch.tensor(0.5), [("a", torch.tensor(2.5), mean)]),
        (torch.tensor(0.75).bfloat16(), [("a", torch.tensor(3.0), mean), ("n", torch.tensor(2**40 + 1), total)]),
        (None, [("v", torch.tensor(1 / 3, dtype=torch.float64), {**mean, "reduce_fx": "max"})]),
        (None, []),
        (torch.tensor(0.125), [("a", torch.tensor(7.0), mean)]),
    ]  # fmt: skip
    got = []
    for loss, logs in steps:
        records = [LogRecord(name, value, options, 1.0) for name, value, options in logs]
        report = relay.relay(StepReport(loss, records) if rank == 1 else None)
        loss_got = None if report.loss is None else (report.loss.item(), str(report.loss.dtype))
        got.append((loss_got, [(r.name, r.value.item(), str(r.value.dtype), r.options) for r in report.logs]))
    relay.flush()
    dist.destroy_process_group()
    with open(f"{out}/{rank}.pkl", "wb") as f:
        pickle.dump((got, len(told)), f)


@pytest.mark.parametrize("apart", [False, True], ids=["one message", "values apart on the device group"])
def test_the_report_relay_sends_what_the_values_mean_only_when_it_changes(tmp_path, apart):
    import pickle

    import torch.multiprocessing as mp
    from conftest import free_port

    mp.start_processes(_relay_meanings_rank, args=(free_port(), str(tmp_path), apart), nprocs=2, start_method="fork")
    (sent, _), (received, unpickled) = (pickle.loads((tmp_path / f"{r}.pkl").read_bytes()) for r in (1, 0))
    assert received == sent  # every value exact in its own dtype (2**40 + 1 as an int64, 1/3 as a float64)
    assert unpickled == 5  # the first report, a new name, new dtypes and options, no loss, nothing: not the repeats


def test_batches_in_containers_torchs_pytree_does_not_know_split_once_their_types_are_known():
    # Hugging Face's data collators return a BatchEncoding (a UserDict); a dataclass is a common batch too: to
    # torch's pytree each was one leaf, and the pipeline refused the batch as holding no tensor
    from transformers import BatchEncoding

    @dataclasses.dataclass
    class Batch:
        tokens: torch.Tensor
        name: str = "train"

    for batch in (BatchEncoding({"tokens": torch.arange(8).reshape(4, 2)}), Batch(torch.arange(8).reshape(4, 2))):
        before = signature(batch)
        assert known_containers(batch) is batch and batch_size_of(batch) == 4
        parts = split_batch(batch, 2)
        assert [type(p) for p in parts] == [type(batch)] * 2, parts
        assert torch.equal(parts[1]["tokens"] if isinstance(batch, BatchEncoding) else parts[1].tokens,
                           torch.arange(4, 8).reshape(2, 2))  # fmt: skip
        assert signature(batch) != before  # the tensors' shapes sign the batch now, not its type's name
    assert Batch(torch.zeros(4)).name == split_batch(Batch(torch.zeros(4)), 2)[0].name
