"""Each data-parallel replica's share of the global batch, when dp need not divide it.

The global batch of a step is `train.global_batch` sequences in one fixed order (the data
order does not depend on dp). Replica r takes a contiguous run of it as whole micro-batches of
`train.micro_batch` sequences. When dp divides the micro-batch count every replica takes the
same number; otherwise (a job shrunk by a lost node with `resilience.shrink = "keep-batch"`) the
first `total % dp` replicas take one micro-batch more. The loss is the sum of token losses over
the global batch divided by its loss-bearing token count, and ZeRO sums gradients over dp, so
the gradient is the full batch's whatever the split: the optimizer's trajectory does not move
when the job shrinks. What it costs is time: a step lasts as long as the busiest replica.
"""

from __future__ import annotations

from dataclasses import dataclass

from megascale.config.fields import ConfigError

KEEP_BATCH = "keep-batch"
DIVIDE = "divide"


@dataclass(frozen=True)
class BatchShares:
    """How `global_batch` sequences are split over `dp` replicas in micro-batches of `micro_batch`."""

    global_batch: int
    micro_batch: int
    dp: int

    @property
    def total(self) -> int:
        """Micro-batches in the global batch."""
        return self.global_batch // self.micro_batch

    @property
    def even(self) -> bool:
        """Every replica takes the same number of micro-batches."""
        return self.global_batch % (self.micro_batch * self.dp) == 0

    @property
    def most(self) -> int:
        """The most micro-batches any replica takes: what buffers are sized for and a step waits on."""
        return -(-self.total // self.dp)

    @property
    def fewest(self) -> int:
        return self.total // self.dp

    def micro_batches(self, dp_rank: int) -> int:
        """Micro-batches replica `dp_rank` runs per step."""
        return self.fewest + (1 if dp_rank < self.total % self.dp else 0)

    def first_sequence(self, dp_rank: int) -> int:
        """Position in the global batch of replica `dp_rank`'s first sequence."""
        return (self.fewest * dp_rank + min(dp_rank, self.total % self.dp)) * self.micro_batch

    def sequences(self, dp_rank: int) -> int:
        return self.micro_batches(dp_rank) * self.micro_batch

    def check(self, mode: str) -> None:
        """Raise ConfigError when this split cannot train the global batch under `mode`
        (`resilience.shrink`): "divide" needs dp to divide it; "keep-batch" needs whole
        micro-batches and at least one per replica."""
        g, b, dp = self.global_batch, self.micro_batch, self.dp
        if mode == DIVIDE:
            if not self.even:
                raise ConfigError(
                    f"train.global_batch={g} must be a multiple of train.micro_batch * parallel.dp = "
                    f"{b} * {dp} = {b * dp} (resilience.shrink='divide'; 'keep-batch' lets replicas "
                    "take uneven shares)"
                )
            return
        if g % b:
            raise ConfigError(
                f"train.global_batch={g} must be a multiple of train.micro_batch={b} "
                "(replicas take whole micro-batches)"
            )
        if self.total < dp:
            raise ConfigError(
                f"train.global_batch={g} is {self.total} micro-batch(es) of train.micro_batch={b}: fewer "
                f"than parallel.dp={dp} replicas, so some would have nothing to train on; use "
                f"parallel.dp <= {self.total}, a smaller micro_batch, or a larger global_batch"
            )

    def describe(self) -> str:
        """'8 micro-batches on each of 4 replicas' or '3 micro-batches on 2 replicas, 2 on 1'."""
        more = self.total % self.dp
        if not more:
            return f"{self.fewest} micro-batch(es) of {self.micro_batch} on each of {self.dp} replica(s)"
        return (
            f"{self.most} micro-batch(es) of {self.micro_batch} on {more} replica(s), {self.fewest} on {self.dp - more}"
        )
