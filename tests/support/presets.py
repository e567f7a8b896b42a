"""The tiny models tests build and train, as config overrides, in one place: a test file composes
one of these and says only what it changes (a vocabulary, a strategy, a wider feed-forward). Each
keeps grouped-query attention (2 KV heads for 4 query heads) and two blocks; a later override of the
same key wins.

    TINY_MODEL   width 32: most tests that build a model or train a few CPU steps
    SMALL_MODEL  width 64: where the numbers need some width (bf16 precision, losses that must fall)
    TINY_MOE     moe-tiny at TINY_MODEL's width, with small experts
"""

TINY_MODEL = ["model.dim=32", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=64",
              "model.n_layers=2"]
SMALL_MODEL = ["model.dim=64", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=96",
               "model.n_layers=2"]
TINY_MOE = ["model=moe-tiny", "model.dim=32", "model.n_heads=4", "model.n_kv_heads=2",
            "model.ffn_dim=32", "model.n_layers=2", "model.moe.expert_dim=16"]
