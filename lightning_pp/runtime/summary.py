"""Lightning's model summary without the FLOPs it did not count.

Lightning counts a summary's FLOPs only by running the module's ``example_input_array`` through it at fit
start; a module without one gets "Total FLOPs: 0" and a column of zeros, as if the model cost nothing. Under
the pipeline no batch has reached the module by then (its structure is learned at the first batch), so
nothing else could be counted either: those callbacks print the table without FLOPs. Parameters are those
of the whole module, which is still whole at fit start on every rank.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelSummary, RichModelSummary
from lightning.pytorch.utilities.model_summary.model_summary import (
    _format_summary_table,
    get_formatted_model_size,
    get_human_readable_count,
)

_log = logging.getLogger("lightning.pytorch.callbacks.model_summary")  # where Lightning prints its own


def summarize_counted_flops(trainer: Trainer) -> None:
    """Before fit start: Lightning's own summary callbacks (not a user's subclass) print no FLOPs where the
    module has no ``example_input_array``."""
    if trainer.lightning_module.example_input_array is not None:
        return
    for callback in trainer.callbacks:
        if type(callback) in (ModelSummary, RichModelSummary):
            callback.summarize = partial(_without_flops, rich=type(callback) is RichModelSummary)  # type: ignore


def _without_flops(
    summary_data: list[tuple[str, list[str]]],
    total_parameters: int,
    trainable_parameters: int,
    model_size: float,
    total_training_modes: dict[str, int],
    total_flops: int,
    rich: bool,
    **summarize_kwargs: Any,
) -> None:
    columns = [column for column in summary_data if column[0] != "FLOPs"]
    if not rich:
        table = _format_summary_table(
            total_parameters, trainable_parameters, model_size, total_training_modes, total_flops, *columns
        )
        _log.info("\n" + table.rpartition("\n")[0])  # its last line is the total FLOPs
        return
    from rich import get_console
    from rich.table import Table

    table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
    for name, _ in columns:
        right = name.startswith("Params") or name.endswith("sizes")
        table.add_column(name, justify="right" if right else "left", style="dim" if name == " " else None)
    for row in zip(*(values for _, values in columns)):
        table.add_row(*row)
    totals = Table.grid(expand=True)
    for label, value in [
        ("Trainable params", get_human_readable_count(trainable_parameters)),
        ("Non-trainable params", get_human_readable_count(total_parameters - trainable_parameters)),
        ("Total params", get_human_readable_count(total_parameters)),
        ("Total estimated model params size (MB)", get_formatted_model_size(model_size)),
        ("Modules in train mode", total_training_modes["train"]),
        ("Modules in eval mode", total_training_modes["eval"]),
    ]:
        totals.add_row(f"[bold]{label}[/]: {value}")
    get_console().print(table)
    get_console().print(totals)
