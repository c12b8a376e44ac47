"""The error users see for a configuration the pipeline cannot run."""


class PipelineConfigError(ValueError):
    """A configuration the pipeline cannot run; the message names the value and the fix."""
