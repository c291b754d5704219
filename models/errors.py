"""User-facing errors: the one error type for bad input, at the bottom of the import graph.

It lives here, in a leaf module that imports nothing, so that every layer (models, kernels,
parallelisms, planner, trainer, scripts) can raise it without importing `trainer/`.

`ConfigError` is raised for bad input (config keys, recipe/data/tokenizer/checkpoint paths).
The command-line entry point turns it into one `error: ...` line on stderr and exit code 2.
Its message must name the key or file and say what is allowed.
"""


class ConfigError(ValueError):
    """Bad user input; printed as `error: <message>` with exit code 2."""


class NonFiniteLoss(RuntimeError):
    """Training hit a non-finite gradient norm or state; printed as `error: <message>`, exit code 1.

    Raised by the trainer's loop and by the engine's `optimizer_step` (trainer/)."""


def check_choice(key: str, value, choices) -> None:
    """The one refusal of a value outside its key's choices: `key: 'x' is not allowed; allowed: a, b`.

    Each list of choices has one home (a tuple next to what it chooses: `AC_MODES`,
    `ATTENTION_BACKENDS`, ...); the config's parse (`[section] key` metadata) and every later
    check of the same list call this, so the list and its message are written once."""
    if value not in choices:
        raise ConfigError(f"{key}: {value!r} is not allowed; allowed: {', '.join(map(str, choices))}")
