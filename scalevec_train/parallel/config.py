"""The parallelism options (`distributed.*` in the config)."""

from dataclasses import dataclass
from typing import Literal

from scalevec_train.infra.errors import ScalevecError, check_choices, choice

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
    # on CPU too: it needs a C compiler there; under expert parallelism a block's graph breaks where its
    # experts run). The first steps are slower while it compiles
    compile: bool = False
    # expert parallelism: the routed experts of every MoE layer are split over groups of this many ranks
    # (each holds num_experts / N of them, tokens travel to them by all-to-all) and sharded by FSDP over
    # the rest of the data-parallel ranks; 1 = every expert sharded by FSDP like any other weight
    expert_parallel: int = 1

    def validate(self) -> None:
        check_choices(self, "distributed.")
        if self.replicate < 0:
            raise ScalevecError("distributed.replicate", f"{self.replicate} is negative.",
                                "use 0 (one replica group per node), 1 (plain FSDP) or a group count.")
        if self.expert_parallel < 1:
            raise ScalevecError("distributed.expert_parallel", f"{self.expert_parallel} is below 1.",
                                "use 1 (no expert parallelism) or a divisor of the number of experts.")
