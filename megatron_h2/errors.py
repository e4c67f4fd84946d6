"""Errors that megatron_h2 reports to users as a single line."""


class ConfigError(ValueError):
    """Bad user input (flags, files, plans, checkpoints).

    The message is one line that says what is wrong and what to fix. Entry points catch it and
    print ``error: <message>`` without a traceback, before any heavy work or process group starts.
    """


class RankConfigError(ConfigError):
    """Bad input that only some ranks can see (for example their own chip is unavailable).

    Unlike a plain ConfigError, which every rank detects alike and rank 0 reports for all, each
    rank that hits this one reports it, with its rank number.
    """


class JobConfigError(ConfigError):
    """Bad input that the ranks found together after their process groups started (for example a
    damaged checkpoint part, each part checked by one rank): every rank raises the same message
    and rank 0 reports it for all."""


class TrainingError(RuntimeError):
    """Training cannot continue (for example the loss became NaN). One line, shown once."""
