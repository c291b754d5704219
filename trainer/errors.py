"""User-facing errors.

`ConfigError` is raised for bad input (config keys, recipe/data/tokenizer/checkpoint paths).
The command-line entry point turns it into one `error: ...` line on stderr and exit code 2.
Its message must name the key or file and say what is allowed.
"""


class ConfigError(ValueError):
    """Bad user input; printed as `error: <message>` with exit code 2."""
