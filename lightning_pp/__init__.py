"""Pipeline parallelism for PyTorch Lightning: ``Trainer(strategy="pipeline")``.

Importing the package registers the strategy names ``"pipeline"`` (1F1B) and ``"pipeline_gpipe"``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_pp.callbacks import GenerateSamples, PipelineMonitor
from lightning_pp.errors import DamagedCheckpointError, PipelineConfigError, UntrustedCheckpointError
from lightning_pp.layout.replica_groups import FaultTolerance
from lightning_pp.lifecycle.failure import PipelinePeerError
from lightning_pp.memory.materialize import empty_weights, materialize, name_seed
from lightning_pp.runtime.weighting import label_tokens
from lightning_pp.strategy import PipelineStrategy

__all__ = [
    "DamagedCheckpointError",
    "FaultTolerance",
    "GenerateSamples",
    "PipelineConfigError",
    "PipelineMonitor",
    "PipelinePeerError",
    "PipelineStrategy",
    "UntrustedCheckpointError",
    "empty_weights",
    "label_tokens",
    "materialize",
    "name_seed",
]
__version__ = "0.1.0"

if "pipeline" not in StrategyRegistry:
    PipelineStrategy.register_strategies(StrategyRegistry)
