"""A fit resumed from a checkpoint trains the batches an uninterrupted fit would have trained, in its order.

Killing and resuming one-process Lightning 2.6 runs (torchdata's ``StatefulDataLoader``) at every pair and
triple of points found three ways a resumed run drifts, each independent of the pipeline:

- ``ModelCheckpoint`` does not save the step it last saved at. Resumed inside an accumulation window,
  ``global_step`` still equals the restored step at the next batch's end, so it saves again: a checkpoint
  in the middle of a window, whose accumulated gradient no checkpoint holds. A later attempt that resumes
  from it skips a batch (20 of 44 kill pairs).
- A checkpoint written at the end of an epoch's last batch restores an epoch that is over but not closed:
  the fit loop runs it again on the exhausted loader, zero batches, and counts it, so a whole epoch is lost.
- The loader's state is loaded before the sampler is told its epoch, so a shuffled epoch (a
  ``DistributedSampler``: replicas, or the strategy's seeded shuffle) resumed mid-way replays epoch 0's
  order; at an epoch boundary the saved state is dropped, and a seeded sampler starts over from its seed.

So at load the checkpoint callbacks know they saved at the restored step, a checkpoint of an epoch's last
batch reads as "epoch closed, the next not begun", and the fit loop tells the sampler its epoch before it
loads the loader's state. With these, every kill chain tried ended bitwise equal to the uninterrupted run.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn


def resume_exactly(trainer: Any, checkpoint: dict[str, Any]) -> None:
    """Called with the checkpoint a fit resumes from, before Lightning restores its callbacks and loops."""
    if trainer is None or trainer.state.fn != TrainerFn.FITTING or "loops" not in checkpoint:
        return
    _close_a_finished_epoch(checkpoint["loops"].get("fit_loop", {}))
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            callback._last_global_step_saved = checkpoint["global_step"]
    _sampler_epoch_before_loader_state(trainer.fit_loop)


def _close_a_finished_epoch(fit: dict[str, Any]) -> None:
    """A checkpoint saved at the end of an epoch's last batch, rewritten as the loop that closed that epoch."""
    if "epoch_progress" not in fit:
        return
    batches, epochs = fit["epoch_loop.batch_progress"], fit["epoch_progress"]
    b, e = batches["current"], epochs["current"]
    at_last_batch_end = (
        batches.get("is_last_batch")
        and b["ready"] == b["started"] == b["processed"] == b["completed"] + 1
        and e["ready"] == e["started"] == e["processed"] + 1 == e["completed"] + 1
    )
    if not at_last_batch_end:
        return
    for part in ("current", "total"):
        epochs[part]["processed"] += 1
        epochs[part]["completed"] += 1
    batches["total"]["completed"] += 1
    batches["is_last_batch"] = False
    for progress in (
        batches,
        fit.get("epoch_loop.scheduler_progress"),
        fit.get("epoch_loop.automatic_optimization.optim_progress"),
    ):
        _zero_current(progress)  # as the epoch loop's reset at the start of the next epoch
    state = fit.setdefault("epoch_loop.state_dict", {})
    state["_batches_that_stepped"] = state.get("_batches_that_stepped", 0) + 1
    for loader_state in fit.get("state_dict", {}).get("combined_loader", []):
        if isinstance(loader_state, dict) and "_iterator_finished" in loader_state:
            loader_state["_iterator_finished"] = True  # the loader's next iter() starts a fresh epoch


def _zero_current(progress: Any) -> None:
    if isinstance(progress, dict):
        for key, value in progress.items():
            if key == "current" and isinstance(value, dict):
                progress[key] = dict.fromkeys(value, 0)
            else:
                _zero_current(value)


def _sampler_epoch_before_loader_state(fit_loop: Any) -> None:
    """The fit loop (this trainer's) sets its samplers' epoch before it loads their state, and loads a state
    saved at an epoch boundary as a finished epoch instead of dropping it."""
    if getattr(fit_loop, "_lightning_pp_exact", False):
        return
    load_states = fit_loop._load_combined_loader_states

    def load_after_the_epoch() -> None:
        combined = fit_loop._combined_loader
        if combined is not None:
            for loader in combined.flattened:
                _set_sampler_epoch(loader, fit_loop.epoch_progress.current.processed)
            states = fit_loop._combined_loader_states_to_load
            if states and not fit_loop.restarting:  # at an epoch boundary Lightning would drop the state
                for state in states:
                    if isinstance(state, dict) and "_iterator_finished" in state:
                        state["_iterator_finished"] = True
                combined._load_state_dicts(states)
                fit_loop._combined_loader_states_to_load = []
                return
        load_states()

    fit_loop._load_combined_loader_states = load_after_the_epoch
    fit_loop._lightning_pp_exact = True
