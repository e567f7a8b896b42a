"""Export to a Hugging Face transformers folder (the CLI: `python -m scalevec_train.export`).

The model is folded first (fold.py), then written as
    model.safetensors        fp32 weights in the Llama layout
                             (model.layers.N.self_attn.q_proj.weight, ...)
    config.json              LlamaForCausalLM when the folded model is a plain Llama (every scale
                             site absorbed: baseline, iwd, hg, dp, or, er, none on models without
                             QK-/post-norms); otherwise ScalevecForCausalLM with
                             modeling_scalevec.py (trust_remote_code): normalizations with weights
                             on map outputs (dnp, unified, qk_norm, post_norm) and
                             mixture-of-experts layers. Its `scale_plan` is the folded model's scale
                             plan, a row per site; the modeling file builds a normalization for
                             every row that names a weight (a site behind a normalization), and
                             nothing else
    tokenizer.json, tokenizer_config.json   a transformers fast tokenizer built from the
                             SentencePiece model (encodes text to the same ids, adds no BOS/EOS), or
                             the run's Hugging Face tokenizer without its post-processor (which
                             would add tokens training never saw)
    tokenizer.model          the SentencePiece model itself (SentencePiece runs only)
Pre-norms whose scales folded away are written as RMSNorm weights of ones. config.json carries the
RoPE base both as `rope_theta` (transformers 4.x) and `rope_parameters` (5.x).
"""

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from scalevec_train.checkpoint.files import check_new_folder, new_folder
from scalevec_train.data.hf_tokenizer import HfTokenizer
from scalevec_train.data.tokenizer import Tokenizer
from scalevec_train.infra.errors import ScalevecError
from scalevec_train.interop.api import load
from scalevec_train.model.fold import fold
from scalevec_train.model.plan import NormKind, SiteRow
from scalevec_train.model.strategies import ScaleSite, site_display_name
from scalevec_train.model.transformer import Transformer

WEIGHTS_FILE = "model.safetensors"
MODELING_FILE = "modeling_scalevec.py"
MODELING_SOURCE = Path(__file__).resolve().parent / "hf_modeling" / MODELING_FILE
_ATTN_MAPS = (("q", "wq"), ("k", "wk"), ("v", "wv"), ("o", "wo"))
# Where the weight of each site behind a normalization (a block's, without "layers.<i>.") lives in
# the transformers layout of modeling_scalevec.py.
_NORM_WEIGHTS = {
    "attn.wq.out_site": "self_attn.q_norm", "attn.wk.out_site": "self_attn.k_norm",
    "attn.wv.out_site": "self_attn.v_norm", "attn.wo.out_site": "self_attn.o_norm",
    "ffn.w_gate.out_site": "mlp.gate_norm", "ffn.w_up.out_site": "mlp.up_norm",
    "ffn.w_down.out_site": "mlp.down_norm",
    "ffn.experts.gate_out": "mlp.experts.gate_norm", "ffn.experts.up_out": "mlp.experts.up_norm",
    "ffn.shared.gate_out": "mlp.shared.gate_norm", "ffn.shared.up_out": "mlp.shared.up_norm",
    "ffn.down_out": "mlp.down_norm",
}
# SentencePiece piece types (sentencepiece_model.proto)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4
_NEVER = -1e9


def export(path: str | Path, out: str | Path, verify: bool = True) -> Path:
    """Export the newest complete checkpoint of a run directory, or one checkpoint, to `out`
    (`verify`: as for load())."""
    model, tokenizer = load(path, verify=verify)
    return export_model(model, tokenizer, out)


def export_model(model: Transformer, tokenizer: Tokenizer, out: str | Path) -> Path:
    """Fold `model` and write it with its tokenizer as a transformers folder `out` (new or empty).
    The folder appears whole or not at all."""
    out = Path(out)
    check_new_folder(out)
    folded = fold(model).cpu().float()
    llama = is_llama(folded)
    tensors = hf_state_dict(folded, llama)
    config = llama_config(folded) if llama else scalevec_config(folded)
    config["eos_token_id"] = tokenizer.eos_id() if tokenizer.eos_id() >= 0 else None
    with new_folder(out) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        _readable_like_other_files(tmp / WEIGHTS_FILE)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if not llama:
            shutil.copyfile(MODELING_SOURCE, tmp / MODELING_FILE)
        write_tokenizer(tokenizer, tmp, folded.cfg.max_seq_len)
    return out


def _readable_like_other_files(path: Path) -> None:
    """safetensors creates its file private (0600); give it the mode any new file gets (umask)."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)


def is_llama(folded: Transformer) -> bool:
    """Whether a folded model is a stock Llama: dense, no normalization on any map's output, no
    scale left."""
    return folded.cfg.moe is None and all(row.param == "fixed" and not row.behind_norm
                                          for row in folded.plan.rows)


def norm_weight_name(row: SiteRow) -> str | None:
    """The transformers name of the normalization weight a site is (None: a site that folds
    away)."""
    if not row.behind_norm:
        return None
    layer, name = site_display_name(row.path)
    return f"model.layers.{layer}.{_NORM_WEIGHTS[name]}.weight"


def _ones_if_fixed(site: ScaleSite) -> torch.Tensor:
    """A normalization's weight: the site's vector (folding left it plain), or ones for a fixed
    site."""
    s = site()
    return torch.ones(site.shape) if s is None else s.detach().clone()


def hf_state_dict(folded: Transformer, llama: bool) -> dict[str, torch.Tensor]:
    """The weights of a folded model under transformers' names (Llama layout, plus the output norms
    and MoE tensors of modeling_scalevec.py). Folding absorbed every pre-norm's sites (input sites),
    so the pre-norms are weightless: ones."""
    cfg = folded.cfg
    out = {"model.embed_tokens.weight": folded.tok_emb.weight}
    for i, block in enumerate(folded.layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = out[p + "post_attention_layernorm.weight"] = torch.ones(
            cfg.dim)
        for name, attr in _ATTN_MAPS:
            out[p + f"self_attn.{name}_proj.weight"] = getattr(block.attn, attr).weight
        ffn = block.ffn
        if cfg.moe is None:
            for name in ("gate", "up", "down"):
                out[p + f"mlp.{name}_proj.weight"] = getattr(ffn, f"w_{name}").weight
            continue
        out[p + "mlp.router.weight"] = ffn.router.weight
        out[p + "mlp.expert_bias"] = ffn.expert_bias
        for name in ("gate", "up", "down"):
            out[p + f"mlp.experts.{name}_proj"] = getattr(ffn.experts, f"w_{name}")
            if ffn.shared is not None:
                out[p + f"mlp.shared.{name}_proj.weight"] = getattr(ffn.shared, f"w_{name}").weight
    for row in folded.plan.rows:
        if row.behind_norm:
            out[norm_weight_name(row)] = _ones_if_fixed(folded.get_submodule(row.path))
    out["model.norm.weight"] = torch.ones(cfg.dim)
    if folded.head is not None:
        out["lm_head.weight"] = folded.head.weight
    elif not llama:
        # modeling_scalevec.py never ties: the head gets its own copy of the embedding.
        out["lm_head.weight"] = folded.tok_emb.weight
    # safetensors stores each tensor once: no views, no shared storage.
    return {k: v.detach().float().contiguous().clone() for k, v in out.items()}


def _common_config(folded: Transformer) -> dict:
    cfg = folded.cfg
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "initializer_range": cfg.init_std,
        "bos_token_id": None,
        "pad_token_id": None,
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def llama_config(folded: Transformer) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **_common_config(folded),
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": folded.head is None,
        "use_cache": True,
    }


def plan_rows(folded: Transformer) -> list[dict]:
    """The folded model's scale plan as JSON: a row per site (a fixed one too), with `weight`, the
    transformers name of the normalization weight it is, and `per_head`, whether that normalization
    acts per attention head."""
    return [{"site": row.path, "shape": list(row.shape), "role": row.role, "param": row.param,
             "side": row.side, "maps": [m.name for m in row.maps],
             "norm": row.norm and row.norm.label, "folds": row.fold,
             "weight": norm_weight_name(row),
             "per_head": row.behind_norm and row.norm.kind is NormKind.HEAD}
            for row in folded.plan.rows]


def scalevec_config(folded: Transformer) -> dict:
    cfg = folded.cfg
    moe = None
    if cfg.moe is not None:
        shared = cfg.moe.num_shared_experts * (cfg.moe.shared_expert_dim or cfg.ffn_dim)
        moe = {"num_experts": cfg.moe.num_experts, "top_k": cfg.moe.top_k,
               "expert_dim": cfg.moe.expert_dim, "shared_expert_dim": shared,
               "score_func": cfg.moe.score_func, "renormalize": cfg.moe.renormalize}
    return {
        "architectures": ["ScalevecForCausalLM"],
        "model_type": "scalevec",
        "auto_map": {"AutoConfig": "modeling_scalevec.ScalevecConfig",
                     "AutoModelForCausalLM": "modeling_scalevec.ScalevecForCausalLM"},
        **_common_config(folded),
        "scale_plan": plan_rows(folded),
        "moe": moe,
        "tie_word_embeddings": False,
        "use_cache": False,
    }


def write_tokenizer(tokenizer: Tokenizer, out: Path, max_len: int) -> None:
    """tokenizer.json and tokenizer_config.json for transformers' PreTrainedTokenizerFast; for a
    SentencePiece tokenizer also the model itself as tokenizer.model."""
    if isinstance(tokenizer, HfTokenizer):
        spec = json.loads(tokenizer.backend.to_str())
        # training added no BOS/EOS to a document's tokens: neither may this
        spec["post_processor"] = None
        (out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False, indent=2) + "\n")
        special = {"eos_token": tokenizer.backend.id_to_token(tokenizer.eos_id())}
    else:
        proto_bytes = tokenizer.serialized_model_proto()
        fast = fast_tokenizer(proto_bytes)
        (out / "tokenizer.model").write_bytes(proto_bytes)
        fast.save(str(out / "tokenizer.json"))
        pieces = [tokenizer.id_to_piece(i) for i in range(tokenizer.get_piece_size())]
        special = {"unk_token": tokenizer.unk_id(), "eos_token": tokenizer.eos_id(),
                   "bos_token": tokenizer.bos_id(), "pad_token": tokenizer.pad_id()}
        special = {k: pieces[i] for k, i in special.items() if i >= 0}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": False,
        "add_eos_token": False,
        # scalevec reads "</s>" in text as characters, not as the end of a document: so do we.
        "split_special_tokens": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def fast_tokenizer(proto_bytes: bytes):
    """A `tokenizers` Tokenizer that encodes like the SentencePiece model: same pieces, same merge
    order (BPE: a pair merges in the order of the merged piece's score, as SentencePiece does), byte
    fallback for characters outside the vocabulary, user-defined pieces (the newline) matched first,
    and the text otherwise unchanged except spaces becoming U+2581."""
    # needs protobuf, like transformers' own conversion
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(proto_bytes)
    _check_tokenizer_settings(proto, sentencepiece_model_pb2.TrainerSpec)
    pieces = [(p.piece, p.score, p.type) for p in proto.pieces]
    unk = next(i for i, (_, _, kind) in enumerate(pieces) if kind == _UNKNOWN)
    byte_fallback = proto.trainer_spec.byte_fallback
    if proto.trainer_spec.model_type == sentencepiece_model_pb2.TrainerSpec.BPE:
        vocab = {piece: i for i, (piece, _, _) in enumerate(pieces)}
        merges = []
        for i, (piece, _, kind) in enumerate(pieces):
            if kind != _NORMAL:
                continue
            for cut in range(1, len(piece)):
                left, right = piece[:cut], piece[cut:]
                if left in vocab and right in vocab:
                    merges.append((i, left, right))
        merges.sort(key=lambda m: (-pieces[m[0]][1], m[0], len(m[1])))
        model = models.BPE(vocab, [(left, right) for _, left, right in merges],
                           unk_token=pieces[unk][0], byte_fallback=byte_fallback, fuse_unk=True)
    else:
        # SentencePiece never matches control, unknown or byte pieces against text; a score no path
        # would choose does the same here.
        scored = [(piece, score if kind in (_NORMAL, _USER_DEFINED) else _NEVER)
                  for piece, score, kind in pieces]
        model = models.Unigram(scored, unk, byte_fallback=byte_fallback)
    fast = Tokenizer(model)
    fast.normalizer = normalizers.Replace(" ", "\u2581")
    fast.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                      decoders.Fuse()])
    fast.add_tokens([AddedToken(piece, normalized=False, special=False)
                     for piece, _, kind in pieces if kind == _USER_DEFINED])
    fast.add_special_tokens([AddedToken(piece, normalized=False, special=True)
                             for piece, _, kind in pieces if kind in (_UNKNOWN, _CONTROL)])
    return fast


def _check_tokenizer_settings(proto, kinds) -> None:
    """The conversion reproduces SentencePiece models trained the way scalevec trains them (text
    kept as is); other normalizations would need rules it does not implement. `kinds`: the
    TrainerSpec class."""
    spec = proto.normalizer_spec
    unsupported = []
    if proto.trainer_spec.model_type not in (kinds.BPE, kinds.UNIGRAM):
        unsupported.append("a model type other than bpe/unigram")
    if spec.precompiled_charsmap or spec.name not in ("identity", ""):
        unsupported.append(f"the '{spec.name}' normalization")
    if spec.add_dummy_prefix:
        unsupported.append("add_dummy_prefix")
    if spec.remove_extra_whitespaces:
        unsupported.append("remove_extra_whitespaces")
    if unsupported:
        raise ScalevecError("tokenizer.model", f"uses {', '.join(unsupported)}, which the "
                            "conversion to a transformers tokenizer does not reproduce.",
                            "export models whose tokenizer scalevec trained (data.tokenizer_path "
                            "left empty).")
