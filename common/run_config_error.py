"""The one error of a run config that cannot run: raised by the stages' own checks (``assets``) and by the
checks before a run starts (``runs.run_config``), so a caller catches one class."""


class RunConfigError(ValueError):
    """A run config that Dagster's schema, a stage's library config or a whole-run check rejects (the message
    names the op and field). The one class for all of them, so a caller catches one."""
