"""The checkpoint options (`checkpoint.*`): how often a run saves, what it keeps, how it writes, and
whether a resume checks what it reads."""

from dataclasses import dataclass

from scalevec_train.infra.errors import ScalevecError


@dataclass
class CheckpointConfig:
    # save every this many steps (and at the end of the run); 0: only at the end
    every: int = 0
    # when set, checkpoint.every is the steps of this many tokens per parameter (N as for
    # train.tokens_per_param; rounded down, at least one step): checkpoints at the same budgets on
    # every model of a ladder, for WSD branches to start from; null: checkpoint.every
    every_tokens_per_param: float | None = None
    # keep the newest this many complete checkpoints; older ones are deleted
    keep_last: int = 2
    # write checkpoints in the background while training goes on
    # (torch.distributed.checkpoint.async_save)
    async_save: bool = False
    # check every file of the checkpoint a run resumes or branches from against the checksums
    # recorded when it was written, before reading it (the ranks share the reading); a mismatch
    # refuses the run, naming the file and the newest earlier checkpoint that verifies. false: read
    # it unchecked (one you trust)
    verify: bool = True

    def validate(self) -> None:
        if self.every < 0 or self.keep_last < 1:
            raise ScalevecError("checkpoint.every" if self.every < 0 else "checkpoint.keep_last",
                                "every must be >= 0 and keep_last >= 1.",
                                "use checkpoint.every=0 to save only at the end, "
                                "and keep at least one.")
        if self.every_tokens_per_param is not None and self.every_tokens_per_param <= 0:
            raise ScalevecError("checkpoint.every_tokens_per_param", f"must be positive, got "
                                f"{self.every_tokens_per_param}.", "use a number above 0, or null.")
