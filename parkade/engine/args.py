"""`EngineArgs`: every engine setting, with vLLM's names, and how they become an engine.

    EngineArgs = TokenizerOptions (model, tokenizer)        -> the front end
               + ExecutorOptions (dtype, block_size, ...)    -> the executor, as `parkade executor`
               + SchedulingOptions (max_num_seqs, ...)       -> the scheduler, as `parkade scheduler`
               + EngineOptions (disable_log_stats, ...)      -> the in-process engine only

Each field is declared once, in the options class of the component that reads it; the services'
flags are made from the same classes, so both paths take the same settings. The vLLM arguments
Parkade does not implement are refused by name (`unsupported.py`). Torch-free: the command line
makes `parkade offline`'s flags from it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

from parkade.engine.engine_options import EngineOptions
from parkade.engine.unsupported import check_unsupported, without_unsupported
from parkade.services.common.flags import field_default
from parkade.services.executor.options import ExecutorOptions
from parkade.services.scheduler.config import SchedulingOptions
from parkade.services.tokenizer.frontend import TokenizerOptions

T = TypeVar("T")

# The fields no service reads; `parkade offline` makes no flags of them either.
ENGINE_ONLY_FIELDS = tuple(f.name for f in dataclasses.fields(EngineOptions))


@dataclass(frozen=True, kw_only=True)
class EngineArgs(TokenizerOptions, ExecutorOptions, SchedulingOptions, EngineOptions):
    def __post_init__(self) -> None:
        ExecutorOptions.__post_init__(self)
        SchedulingOptions.__post_init__(self)
        EngineOptions.__post_init__(self)

    def options(self, cls: type[T]) -> T:
        """The settings of one component (`TokenizerOptions`, `ExecutorOptions` or
        `SchedulingOptions`) out of these."""
        return cls(**{f.name: getattr(self, f.name) for f in dataclasses.fields(cls)})  # type: ignore[arg-type]

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """EngineArgs from `LLM(...)` keywords.

        Raises ValueError for a vLLM argument Parkade does not implement (unless its value asks
        for nothing) or a value it cannot honour, naming the argument and what to do instead;
        TypeError for an unknown name, listing the known ones."""
        check_unsupported(kwargs)
        kwargs = without_unsupported(kwargs)
        # None asks for the default, as in vLLM (whose EngineArgs mostly default to None).
        defaults = {f.name: field_default(f) for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in kwargs.items() if v is not None or defaults.get(k) is None}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(
                f"unknown engine argument(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return cls(**kwargs)
