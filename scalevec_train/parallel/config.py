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
    # activation checkpointing per block: none | selective (recompute element-wise ops, keep matmul
    # and attention outputs) | full (recompute whole blocks)
    activation_checkpointing: str = choice("none", ActivationCheckpointing)
    # torch.compile each transformer block and the training loss, each as one graph (fullgraph;
    # inductor, on CPU too: it needs a C compiler there; under expert parallelism a block's graph
    # breaks where its experts run). The first steps are slower while it compiles
    compile: bool = False
    # expert parallelism: the routed experts of every MoE layer are split over groups of this many
    # ranks (each holds num_experts / N of them, tokens travel to them by all-to-all) and sharded by
    # FSDP over the rest of the data-parallel ranks; 1 = every expert sharded by FSDP like any other
    # weight
    expert_parallel: int = 1
    # seconds a collective may wait until this process's first step has finished (joining the group,
    # data preparation, the checkpoint load and the first compile come before it)
    init_timeout_s: float = 1800.0
    # seconds a collective may wait after the first step, checkpoint saves' included: then gloo
    # raises and NCCL's watchdog ends the process (the TORCH_NCCL_* defaults set:
    # parallel/process_group.py)
    timeout_s: float = 300.0
    # the hang watchdog's floor in seconds (parallel/watchdog.py): after the first step, a step,
    # evaluation or save lasting longer than this and 5x the slowest recent one ends the run
    # (exit code 5), the ranks that did not arrive named and every rank's stacks in run_dir/hang/;
    # 0: no watchdog
    hang_s: float = 180.0
    # after a SIGTERM (a preemption's notice), the watchdog ends a span measured before that lasts
    # longer than this or 3x the slowest recent one: keep it within the scheduler's wait before its
    # SIGKILL
    sigterm_grace_s: float = 10.0

    def validate(self) -> None:
        check_choices(self, "distributed.")
        if self.replicate < 0:
            raise ScalevecError("distributed.replicate", f"{self.replicate} is negative.",
                                "use 0 (one replica group per node), 1 (plain FSDP) "
                                "or a group count.")
        if self.expert_parallel < 1:
            raise ScalevecError("distributed.expert_parallel",
                                f"{self.expert_parallel} is below 1.",
                                "use 1 (no expert parallelism) or a divisor of the number of "
                                "experts.")
        for key, why in (("init_timeout_s", "a collective waits this long"),
                         ("timeout_s", "a collective waits this long"),
                         ("sigterm_grace_s",
                          "within the scheduler's wait between its SIGTERM and its SIGKILL")):
            if not getattr(self, key) > 0:
                raise ScalevecError(f"distributed.{key}",
                                    f"{getattr(self, key)} is not a positive number of seconds.",
                                    f"use a positive number of seconds ({why}).")
        if not 0 <= self.hang_s < self.timeout_s:
            raise ScalevecError("distributed.hang_s", f"{self.hang_s} is not in [0, "
                                f"distributed.timeout_s={self.timeout_s}): a collective would time "
                                "out before the watchdog named the rank it waits for.",
                                "use a number of seconds below distributed.timeout_s, or 0 "
                                "(no watchdog).")
