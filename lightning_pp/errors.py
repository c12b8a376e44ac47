"""The errors users see: a configuration the pipeline cannot run, a checkpoint it will not open."""


class PipelineConfigError(ValueError):
    """A configuration the pipeline cannot run; the message names the value and the fix."""


class UntrustedCheckpointError(PipelineConfigError):
    """A checkpoint holds an object whose loading would run code it carries; nothing was loaded.
    ``weights_only=False`` (``consolidate --trust``) opens a checkpoint one trusts."""


class DamagedCheckpointError(PipelineConfigError):
    """A checkpoint whose files are not as they were written; nothing was loaded."""
