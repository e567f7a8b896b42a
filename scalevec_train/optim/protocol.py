"""What the trainer calls on an optimizer beyond torch's own: a step that may be skipped on the device.

The trainer decides on the device whether a step is finite and must not wait for the answer
(training/skip.py). An optimizer that is StepsWhere takes that verdict itself, in its step; Muon
(muon.py) and the fused AdamW (adamw.py) are. torch's for-loop AdamW (adamw.AdamW, the CPU's) is not:
training/skip.py undoes a skipped step of it from copies.
"""

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class StepsWhere(Protocol):
    def step_where(self, taken: torch.Tensor) -> None:
        """The optimizer's step where the 0-dim bool tensor `taken` (on the parameters' device) is true,
        bit for bit as step(); where it is false, parameters and optimizer state (step counters
        included) stay exactly as they were. Reads nothing on the host."""
