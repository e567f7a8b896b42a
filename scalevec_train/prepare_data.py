"""`python -m scalevec_train.prepare_data [overrides]`: prepare the configured data (tokenizer and
token shards) ahead of training. Training does the same on first use; both reuse the cache."""

import sys

from hydra.errors import HydraException

from scalevec_train.config import compose_config
from scalevec_train.data import prepare_data
from scalevec_train.errors import ScalevecError


def main(argv: list[str]) -> int:
    try:
        data = prepare_data(compose_config(argv).data)
    except (ScalevecError, HydraException) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"prepared {data.root}")
    print(f"tokenizer {data.tokenizer_path} (vocab {data.vocab_size}, sha256 {data.tokenizer_hash[:12]})")
    for split, manifest in data.manifest.items():
        print(f"{split}: {manifest['num_tokens']:,} tokens in {len(manifest['shards'])} shards")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
