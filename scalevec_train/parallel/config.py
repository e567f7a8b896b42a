"""The parallelism options (`distributed.*` in the config)."""

from dataclasses import dataclass
from typing import Literal

from scalevec_train.errors import ScalevecError, check_choices, choice

ActivationCheckpointing = Literal["none", "selective", "full"]


@dataclass
class DistributedConfig:
    # HSDP replica groups: 1 = FSDP over all ranks; k = shard within groups of world/k ranks and
    # replicate across the k groups; 0 = one group per node (world / LOCAL_WORLD_SIZE)
    replicate: int = 0
    # activation checkpointing per block: none | selective (recompute element-wise ops, keep matmul and
    # attention outputs) | full (recompute whole blocks)
    activation_checkpointing: str = choice("none", ActivationCheckpointing)
    # torch.compile each transformer block and the training loss, each as one graph (fullgraph; inductor,
    # on CPU too: it needs a C compiler there). The first steps are slower while it compiles
    compile: bool = False

    def validate(self) -> None:
        check_choices(self, "distributed.")
        if self.replicate < 0:
            raise ScalevecError("distributed.replicate", f"{self.replicate} is negative.",
                                "use 0 (one replica group per node), 1 (plain FSDP) or a group count.")
