"""`Rule`: one row of the step plan's refusal table (trainer/step/plan.py `RULES`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Rule:
    """One refused combination: `key` is the config key to change, `when` says in words when the
    rule refuses (docs/rules.md), `refuses` is that test (of a `StepRequest`), and `why` the
    message after `key: `, which ends in what is allowed."""

    key: str
    when: str
    refuses: Callable[[Any], bool]
    why: str

    def message(self, request) -> str:
        return f"{self.key}: {self.why}".format(r=request)
