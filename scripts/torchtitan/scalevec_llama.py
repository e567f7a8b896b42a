"""torchtitan's Llama 3 training on the shape of a scalevec dense preset, for
scripts/bench_torchtitan.py.

torchtitan imports this module through `--experimental.custom_import scalevec_llama`. It registers
the train spec `scalevec_llama`: torchtitan's own Llama 3 model, parallelization, optimizer,
schedule and loss, with one flavor per scalevec dense preset (same width, depth, heads, FFN width,
vocabulary and RoPE base; Llama 3 does not tie its embeddings, so the comparison runs scalevec
untied too) and a data loader of random tokens (no tokenizer or dataset download on the GPU host; a
step's cost does not depend on the token values).
"""

import dataclasses
import itertools

import torch
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.models import llama3
from torchtitan.models.llama3 import TransformerModelArgs
from torchtitan.protocols.train_spec import register_train_spec

from scalevec_train.config import compose_config

PRESETS = ("dense-0.12b", "dense-1b", "dense-2b")


def model_args(preset: str) -> TransformerModelArgs:
    m = compose_config([f"model={preset}"]).model
    # Llama 3's FFN width is 8/3 dim rounded up to a multiple of `multiple_of`: with
    # multiple_of = ffn_dim it is exactly ffn_dim whenever 8/3 dim <= ffn_dim, as for every dense
    # preset.
    if int(8 * m.dim / 3) > m.ffn_dim:
        raise ValueError(f"{preset}: ffn_dim {m.ffn_dim} < 8/3 dim; torchtitan's Llama 3 "
                         "cannot express it")
    return TransformerModelArgs(dim=m.dim, n_layers=m.n_layers, n_heads=m.n_heads,
                                n_kv_heads=m.n_kv_heads, vocab_size=m.vocab_size,
                                multiple_of=m.ffn_dim, norm_eps=m.norm_eps, rope_theta=m.rope_theta,
                                max_seq_len=m.max_seq_len)


class RandomTokens(BaseDataLoader):
    """A few fixed batches of uniform random tokens, cycled (inputs and their next-token labels)."""

    def __init__(self, batch: int, seq_len: int, vocab_size: int, seed: int = 0, distinct: int = 8):
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(vocab_size, (distinct, batch, seq_len + 1), generator=g)
        self.inputs, self.labels = tokens[..., :-1].contiguous(), tokens[..., 1:].contiguous()

    def __iter__(self):
        for i in itertools.cycle(range(len(self.inputs))):
            yield {"input": self.inputs[i]}, self.labels[i]

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


def build_random_tokens(dp_world_size: int, dp_rank: int, tokenizer, job_config,
                        **kwargs) -> RandomTokens:
    flavor = SPEC.model_args[job_config.model.flavor]
    return RandomTokens(job_config.training.local_batch_size, job_config.training.seq_len,
                        flavor.vocab_size, seed=dp_rank)


SPEC = dataclasses.replace(llama3.get_train_spec(), model_args={p: model_args(p) for p in PRESETS},
                           build_dataloader_fn=build_random_tokens, build_tokenizer_fn=None,
                           build_validator_fn=None)
register_train_spec("scalevec_llama", SPEC)
