"""`python -m scalevec_train.prepare_data [overrides]`: prepare the configured data (tokenizer and
token shards) ahead of training. Training does the same on first use; both reuse the cache.

The same command under torchrun (RANK, WORLD_SIZE, LOCAL_WORLD_SIZE) or as the tasks of a SLURM
array (SLURM_ARRAY_TASK_ID, SLURM_ARRAY_TASK_COUNT) shares the work: each process encodes its parts,
and the last to finish writes the prepared folder, the same as one process would (data/parts.py).
The cache (data.cache_dir) must be on a file system that every process sees.
"""

import os
import sys
from dataclasses import dataclass

from scalevec_train.data import prepare_share
from scalevec_train.data.mixture import MixtureData
from scalevec_train.data.parts import launch_processes
from scalevec_train.run import cli


@dataclass
class Options:
    """prepare_data has no options of its own: its arguments are config overrides
    (data=..., data.*)."""


def run(_: Options, raw) -> int:
    # Imported here, not above: the encoding worker processes import this module again, and need
    # neither Hydra nor the config (which imports torch) to start (cli composes the config lazily
    # too).
    from scalevec_train.config import to_config

    rank, world, local = launch_processes(dict(os.environ))
    data = prepare_share(to_config(raw).data, rank, world, local)
    if data is None:
        print(f"process {rank} of {world}: its parts are written; the last process to finish "
              "merges them")
        return 0
    for entry, prepared in data.sources if isinstance(data, MixtureData) else [(None, data)]:
        print(f"prepared {prepared.root}" + (f" (source {entry.name})" if entry else ""))
        for split, manifest in prepared.manifest.items():
            print(f"{split}: {manifest['num_tokens']:,} tokens in {len(manifest['shards'])} shards")
    print(f"tokenizer {data.tokenizer_path} (vocab {data.vocab_size}, sha256 "
          f"{data.tokenizer_hash[:12]})")
    return 0


def main(argv: list[str]) -> int:
    return cli.main(argv, Options, run, overrides=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
