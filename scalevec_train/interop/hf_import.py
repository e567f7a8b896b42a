"""Start from a Hugging Face Llama-architecture folder (config.json + safetensors weights):
continued pre-training under any scale strategy.

    model = import_llama("path/to/llama", scale=ScaleConfig(name="unified", ...))   # a new model
    init_from_hf(model, "path/to/llama")                                            # a built one

Matrices are copied. Every scale site starts at 1: the RMSNorm weights g of the Hugging Face model
fold into the columns of the maps they feed (W diag(g)), except where the model has exactly one
plain site in that place (baseline, iwd), which takes g itself. Strategies that add no normalization
therefore compute the Hugging Face model's function at step 0; dnp/unified (and the
qk_norm/post_norm model options) add normalizations and start from a nearby function. Only
safetensors files are read: pickle-based .bin checkpoints can run code when loaded.
"""

import dataclasses
import json
from pathlib import Path

import torch

from scalevec_train.infra.errors import ScalevecError, listing
from scalevec_train.model.config import ModelConfig, ScaleConfig
from scalevec_train.model.plan import PreNormPlan, ScalePlan
from scalevec_train.model.strategies import scale_sites
from scalevec_train.model.transformer import Transformer

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Buffers some older checkpoints carry; recomputed, never needed.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


class HFWeights:
    """The config and tensors of a Hugging Face folder; tensors are read on demand, as fp32."""

    def __init__(self, hf_dir: str | Path):
        self.root = Path(hf_dir)
        config_path = self.root / "config.json"
        if not config_path.is_file():
            raise ScalevecError(str(config_path), "is missing: not a Hugging Face model folder.",
                                "point at a folder written by save_pretrained (config.json, "
                                "*.safetensors).")
        try:
            self.config = json.loads(config_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ScalevecError(str(config_path), f"cannot be read ({e}).") from None
        self._open: dict[Path, object] = {}
        self.files = self._weight_files()

    def _weight_files(self) -> dict[str, Path]:
        """Tensor name -> the safetensors file that holds it."""
        index = self.root / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
                raise ScalevecError(str(index), f"is not a safetensors index ({e}).") from None
            paths = {name: self.root / file for name, file in weight_map.items()}
        elif (self.root / SINGLE_FILE).is_file():
            paths = dict.fromkeys(self._keys(self.root / SINGLE_FILE), self.root / SINGLE_FILE)
        elif any(self.root.glob("*.bin")):
            raise ScalevecError(str(self.root), "holds only .bin (pickle) weights, which can run "
                                "code when read.",
                                "convert them to safetensors, e.g. with transformers: "
                                "from_pretrained(dir).save_pretrained(dir, "
                                "safe_serialization=True).")
        else:
            raise ScalevecError(str(self.root), f"holds no {SINGLE_FILE} or {INDEX_FILE}.",
                                "point at a folder written by save_pretrained.")
        return {name: path for name, path in paths.items() if not name.endswith(_IGNORED_SUFFIXES)}

    def _handle(self, path: Path):
        from safetensors import SafetensorError, safe_open

        if path not in self._open:
            if not path.is_file():
                raise ScalevecError(str(path), "is missing (the index names it).",
                                    "download the whole model folder.")
            try:
                self._open[path] = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError) as e:
                raise ScalevecError(str(path), f"is not a readable safetensors file ({e}).",
                                    "download or export it again.") from None
        return self._open[path]

    def _keys(self, path: Path) -> list[str]:
        return list(self._handle(path).keys())

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(self.files[name]).get_slice(name).get_shape())

    def tensor(self, name: str) -> torch.Tensor:
        from safetensors import SafetensorError

        path = self.files[name]
        try:
            return self._handle(path).get_tensor(name).float()
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ScalevecError(str(path), f"cannot give tensor {name} ({e}).",
                                "download or export it again.") from None


def model_config_from_hf(config: dict, where: str = "config.json", name: str = "hf") -> ModelConfig:
    """The scalevec ModelConfig (named `name`) of a Llama-architecture transformers config (a
    config.json dict read from `where`)."""
    kind = config.get("model_type")
    if kind != "llama":
        raise ScalevecError(f"{where}: model_type", f"is {kind!r}; only Llama-architecture "
                            "models import.",
                            "use a LlamaForCausalLM checkpoint.")
    unsupported = {
        "hidden_act": config.get("hidden_act", "silu") != "silu",
        "attention_bias": bool(config.get("attention_bias", False)),
        "mlp_bias": bool(config.get("mlp_bias", False)),
        "rope_scaling": _rope(config)[1] != "default",
    }
    for key, bad in unsupported.items():
        if bad:
            raise ScalevecError(f"{where}: {key}", f"is {config.get(key)!r}; scalevec models use "
                                "SiLU, no biases and plain RoPE.", "import a model without it.")
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    if head_dim * heads != config["hidden_size"]:
        raise ScalevecError(f"{where}: head_dim", f"{head_dim} * {heads} heads != hidden_size "
                            f"{config['hidden_size']}; scalevec needs head_dim = "
                            "hidden_size / heads.")
    return ModelConfig(
        name=name,
        dim=config["hidden_size"], n_layers=config["num_hidden_layers"], n_heads=heads,
        n_kv_heads=config.get("num_key_value_heads") or heads, ffn_dim=config["intermediate_size"],
        vocab_size=config["vocab_size"], max_seq_len=config.get("max_position_embeddings", 2048),
        rope_theta=_rope(config)[0], norm_eps=config.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        init_std=config.get("initializer_range", 0.02))


def _rope(config: dict) -> tuple[float, str]:
    """(RoPE base, rope type) from a transformers 4.x (rope_theta, rope_scaling) or 5.x
    (rope_parameters) config."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0))), kind


def import_llama(hf_dir: str | Path, scale: ScaleConfig | None = None,
                 **model_overrides) -> Transformer:
    """A new scalevec model (CPU, fp32) holding the weights of a Hugging Face Llama folder under the
    strategy `scale` (default baseline). `model_overrides` replace ModelConfig fields that do not
    change the weights' shapes (name, max_seq_len, init_std, ...)."""
    weights = HFWeights(hf_dir)
    scale = scale or ScaleConfig()
    scale.validate()
    hf = model_config_from_hf(weights.config, str(weights.root / "config.json"),
                              f"hf-{weights.root.name}")
    cfg = dataclasses.replace(hf, **model_overrides)
    if (cfg.tie_embeddings and not _takes_final_norm(ScalePlan.build(cfg, scale))
            and not _is_ones(weights, "model.norm.weight")):
        # The final norm's weight must fold into the head, so the head cannot stay the embedding.
        cfg = dataclasses.replace(cfg, tie_embeddings=False)
    cfg.validate()
    with torch.device("meta"):
        model = Transformer(cfg, scale)
    _check_names_and_shapes(model, weights)
    model = model.to_empty(device="cpu")
    model.init_weights(seed=0)
    _copy_in(model, weights)
    return model


def init_from_hf(model: Transformer, hf: str | Path | HFWeights) -> None:
    """Overwrite the weights of a built dense model (plain or FSDP-sharded, after initialization)
    with a Hugging Face Llama folder's, every scale site starting at 1. The model's config must
    match the folder's in every dimension. `hf` is the folder, or what check_init_from returned for
    it."""
    _copy_in(model, hf if isinstance(hf, HFWeights) else check_init_from(model, hf))


def check_init_from(model: Transformer, hf_dir: str | Path) -> HFWeights:
    """Raises unless init_from_hf(model, hf_dir) will work: the configs agree and the folder holds
    every tensor in its shape. Reads the safetensors headers only (and the final norm's weight), so
    `model` may still be on the meta device."""
    weights = HFWeights(hf_dir)
    where = str(weights.root / "config.json")
    hf = model_config_from_hf(weights.config, where)
    cfg = model.cfg
    if cfg.moe is not None:
        raise ScalevecError("init_from", "initializes dense models only; this model is a mixture "
                            "of experts.",
                            "use a dense model config, or train the MoE model from scratch.")
    keys = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "rope_theta",
            "norm_eps")
    differ = [f"model.{k}={getattr(cfg, k)} but the checkpoint has {getattr(hf, k)}"
              for k in keys if getattr(cfg, k) != getattr(hf, k)]
    if differ:
        raise ScalevecError(where, f"does not match the model config: {'; '.join(differ)}.",
                            "set those model.* options to the checkpoint's values.")
    if cfg.tie_embeddings and not hf.tie_embeddings:
        raise ScalevecError("model.tie_embeddings", f"is true, but {where} has an untied "
                            "output head.",
                            "set model.tie_embeddings=false.")
    if (cfg.tie_embeddings and not _takes_final_norm(model.plan)
            and not _is_ones(weights, "model.norm.weight")):
        raise ScalevecError("model.tie_embeddings", "is true, but the final norm's weight must "
                            f"fold into the output head under scale={model.scale.name}, which then "
                            "differs from the embedding.",
                            "set model.tie_embeddings=false.")
    _check_names_and_shapes(model, weights)
    return weights


def _takes_final_norm(plan: ScalePlan) -> bool:
    """Whether the final norm's weight goes into its site (else it folds into the head)."""
    return plan.final.param == "plain"


def _is_ones(weights: HFWeights, name: str) -> bool:
    return name in weights.files and bool((weights.tensor(name) == 1).all())


def _check_names_and_shapes(model: Transformer, weights: HFWeights) -> None:
    cfg = model.cfg
    kv = cfg.n_kv_heads * cfg.head_dim
    expected = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.dim),
                "model.norm.weight": (cfg.dim,)}
    if not weights.config.get("tie_word_embeddings", False) or "lm_head.weight" in weights.files:
        expected["lm_head.weight"] = (cfg.vocab_size, cfg.dim)
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        expected.update({
            p + "input_layernorm.weight": (cfg.dim,),
            p + "post_attention_layernorm.weight": (cfg.dim,),
            p + "self_attn.q_proj.weight": (cfg.dim, cfg.dim),
            p + "self_attn.k_proj.weight": (kv, cfg.dim),
            p + "self_attn.v_proj.weight": (kv, cfg.dim),
            p + "self_attn.o_proj.weight": (cfg.dim, cfg.dim),
            p + "mlp.gate_proj.weight": (cfg.ffn_dim, cfg.dim),
            p + "mlp.up_proj.weight": (cfg.ffn_dim, cfg.dim),
            p + "mlp.down_proj.weight": (cfg.dim, cfg.ffn_dim)})
    missing = sorted(set(expected) - set(weights.files))
    unexpected = sorted(set(weights.files) - set(expected))
    where = str(weights.root)
    if missing or unexpected:
        problems = ([f"missing {listing(missing)}"] if missing else []) + (
            [f"unexpected {listing(unexpected)}"] if unexpected else [])
        raise ScalevecError(where, "does not hold the tensors of a Llama model of its config.json: "
                            f"{'; '.join(problems)}.", "download or export the folder again.")
    wrong = [f"{name} in {weights.files[name].name} is {list(weights.shape(name))}, expected "
             f"{list(shape)}"
             for name, shape in expected.items() if weights.shape(name) != shape]
    if wrong:
        raise ScalevecError(where, f"has tensors of the wrong shape: {listing(wrong)}.",
                            "make config.json and the weights agree (download or export the "
                            "folder again).")


@torch.no_grad()
def _copy_in(model: Transformer, weights: HFWeights) -> None:
    """Every weight from the (checked) folder, norm weights placed or folded into the maps the plan
    says each pre-norm's sites scale, sites reset to 1."""
    for _, site in scale_sites(model):
        site.init_weights()
    _assign(model.tok_emb.weight, weights.tensor("model.embed_tokens.weight"))
    values = {}  # the folder's matrices by the model's parameter names
    norms = []  # (the model's pre-norm, the folder's weight of it)
    for i, block in enumerate(model.plan.blocks):
        p = f"model.layers.{i}."
        values.update(
            {f"layers.{i}.attn.w{n}.weight": weights.tensor(f"{p}self_attn.{n}_proj.weight")
             for n in "qkvo"})
        values.update({f"layers.{i}.ffn.w_{n}.weight": weights.tensor(f"{p}mlp.{n}_proj.weight")
                       for n in ("gate", "up", "down")})
        norms += [(block.attn_norm, f"{p}input_layernorm.weight"),
                  (block.ffn_norm, f"{p}post_attention_layernorm.weight")]
    if model.head is not None:
        values["head.weight"] = weights.tensor("lm_head.weight" if "lm_head.weight" in weights.files
                                               else "model.embed_tokens.weight")
    for plan, name in norms + [(model.plan.final_norm, "model.norm.weight")]:
        _place_norm(model, plan, weights.tensor(name), values)
    for name, value in values.items():
        _assign(model.get_parameter(name), value)


def _place_norm(model: Transformer, plan: PreNormPlan, gamma: torch.Tensor,
                values: dict[str, torch.Tensor]) -> None:
    """A norm weight g: into the one plain site that replaces it, else into the columns of every map
    its sites scale (values[name] <- values[name] diag(g)); a head tied to the embedding takes none
    (the checks above made g ones there)."""
    rows = list(plan.sites.values())
    if len(rows) == 1 and rows[0].param == "plain":
        _assign(model.get_submodule(rows[0].path).scale, gamma)
        return
    for row in rows:
        for m in row.maps:
            if m.weight in values:
                values[m.weight] = values[m.weight] * gamma


def _assign(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full tensor into a parameter, or into this rank's shard of an FSDP (DTensor)
    parameter."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        local = distribute_tensor(full.to(param.device, param.dtype), param.device_mesh,
                                  param.placements, src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)
