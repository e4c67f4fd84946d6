"""Errors that megatron_h2 reports to users as a single line."""


class ConfigError(ValueError):
    """Bad user input (flags, files, plans, checkpoints).

    The message is one line that says what is wrong and what to fix. Entry points catch it and
    print ``error: <message>`` without a traceback, before any heavy work or process group starts.
    """


class TrainingError(RuntimeError):
    """Training cannot continue (for example the loss became NaN). One line, shown once."""
