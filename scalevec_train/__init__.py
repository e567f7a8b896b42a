"""scalevec: pre-training dense and MoE decoders with the scale-vector strategies of arXiv 2605.26895."""
