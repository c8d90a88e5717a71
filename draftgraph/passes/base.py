"""The pass interface: a named transformation of an FX GraphModule with a cache identity."""

from __future__ import annotations

import hashlib
import inspect
from abc import ABC, abstractmethod

from torch import fx


class GraphPass(ABC):
    """A named pass over a Dynamo-level FX graph. `uuid()` changes whenever the pass's source does, and
    is folded into the Inductor cache key of every piece compiled after it (see PassManager.uuid)."""

    name: str

    @abstractmethod
    def __call__(self, gm: fx.GraphModule) -> fx.GraphModule: ...

    def uuid(self) -> str:
        source = inspect.getsource(inspect.getmodule(type(self)))
        return hashlib.sha256(source.encode()).hexdigest()[:16]
