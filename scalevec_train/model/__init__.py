"""The model: a plain nn.Module decoder (dense or mixture of experts) with the scale sites of a
strategy, and folding. Nothing here knows about training, parallelism or checkpoints.

    config.py       ModelConfig, MoEConfig: the shape of the decoder; ScaleConfig: the strategy
    plan.py         ScalePlan: every site a strategy puts on a model, one row each, decided once
    strategies.py   the scale site (its parameterizations), built from a plan row
    layers.py       residual stream, pre-norm, linear map with its sites and output norm, rotary
                    embeddings
    swiglu.py       SwiGLU with its inner sites and fused path (dense feed-forward and experts)
    moe.py          the mixture-of-experts feed-forward layer
    transformer.py  attention, feed-forward, block, the decoder
    fold.py         absorbing foldable sites into the linear maps
"""

from scalevec_train.model.config import ModelConfig, MoEConfig, ScaleConfig
from scalevec_train.model.plan import ScalePlan
from scalevec_train.model.strategies import ScaleSite, scale_sites
from scalevec_train.model.transformer import Transformer

__all__ = ["ModelConfig", "MoEConfig", "ScaleConfig", "ScalePlan", "ScaleSite", "Transformer",
           "scale_sites"]
